"""LlamaIndex retriever over a ``DocumentStore``: nodes that carry their prompt-module handle.

``PromptModuleRetriever`` returns one ``NodeWithScore`` per retrieved chunk: a
``TextNode`` with the chunk's text (so any LlamaIndex synthesizer can read it) and
metadata naming the module (``HANDLE_KEYS``) so ``PromptCacheQueryEngine`` can
splice its cached KV instead. The handle keys are hidden from embedding and LLM
text. ``node_handle`` reads a node's handle back. This module knows nothing about
KV or generation: the store searches, the LLM serves.
"""

from __future__ import annotations

try:
    from llama_index.core.callbacks import CallbackManager
    from llama_index.core.retrievers import BaseRetriever
    from llama_index.core.schema import (
        BaseNode,
        NodeRelationship,
        NodeWithScore,
        QueryBundle,
        RelatedNodeInfo,
        TextNode,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    msg = "the LlamaIndex retriever needs llama-index-core: `pip install pc-rag[llamaindex]`"
    raise ImportError(msg) from e

from pc_rag.errors import PCRagError
from pc_rag.rag.order import DEFAULT_ORDER, check_order
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.handles import ModuleHandle

__all__ = ["HANDLE_KEYS", "PromptModuleRetriever", "handle_node", "node_handle"]

HANDLE_KEYS = ("store_id", "chunk_id", "doc_id", "n_tokens")  # metadata keys a handle node carries


class PromptModuleRetriever(BaseRetriever):
    """The ``similarity_top_k`` chunks of ``store`` most similar to the query, as nodes carrying their handles.

    The nodes are laid out in ``order`` (``pc_rag.rag.order``), the order a query engine references
    them in. Handle keys take precedence over chunk metadata of the same name. A node's id is
    ``"<store_id>-<chunk_id>"``; its source relationship is the chunk's document id.
    """

    def __init__(
        self,
        store: DocumentStore,
        similarity_top_k: int = 5,
        *,
        order: str = DEFAULT_ORDER,
        as_references: bool = False,
        callback_manager: CallbackManager | None = None,
        verbose: bool = False,
    ) -> None:
        """``as_references``: each node's text is its module reference, so an engine that puts node text in a
        prompt (``CondensePlusContextChatEngine``, any turn) has ``PromptCacheLLM`` splice the chunk's KV."""
        if similarity_top_k < 1:
            msg = f"similarity_top_k must be at least 1, got {similarity_top_k}"
            raise PCRagError(msg)
        super().__init__(callback_manager=callback_manager, verbose=verbose)
        self.store = store
        self.similarity_top_k = similarity_top_k
        self.order = check_order(order)
        self.as_references = as_references

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        handles = self.store.search(query_bundle.query_str, self.similarity_top_k, self.order)
        return [handle_node(self.store, h, as_reference=self.as_references) for h in handles]


def handle_node(store: DocumentStore, handle: ModuleHandle, *, as_reference: bool = False) -> NodeWithScore:
    """``handle``'s chunk as a scored ``TextNode`` whose metadata names the module; ``as_reference``: its text is
    the module reference (no metadata in its LLM text: only whitespace may sit between references)."""
    metadata = store.handle_metadata(handle)
    node = TextNode(
        id_=f"{store.store_id}-{handle.chunk_id}",
        text=store.module_ref(handle) if as_reference else handle.text,
        metadata=metadata,
        excluded_embed_metadata_keys=list(HANDLE_KEYS),
        excluded_llm_metadata_keys=list(metadata) if as_reference else list(HANDLE_KEYS),
        relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=handle.doc_id)},
    )
    return NodeWithScore(node=node, score=handle.score)


def node_handle(store: DocumentStore, node: BaseNode | NodeWithScore) -> ModuleHandle:
    """The handle of ``store``'s chunk behind ``node``; ``PCRagError`` if the node names no chunk of this store."""
    base = node.node if isinstance(node, NodeWithScore) else node
    store_id, chunk_id = base.metadata.get("store_id"), base.metadata.get("chunk_id")
    if store_id is None or chunk_id is None:
        msg = (
            f"node {base.node_id!r} carries no prompt-module handle (store_id, chunk_id); "
            "retrieve with pc_rag.retrievers.llama_index.PromptModuleRetriever"
        )
        raise PCRagError(msg)
    if store_id != store.store_id:
        msg = f"node {base.node_id!r} comes from store {store_id}, but the LLM serves store {store.store_id}"
        raise PCRagError(msg)
    score = node.score if isinstance(node, NodeWithScore) and node.score is not None else 0.0
    return store.handle(int(chunk_id), score)
