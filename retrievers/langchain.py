"""LangChain retriever over a ``DocumentStore``: documents that carry their prompt-module handle.

``PromptModuleRetriever`` returns one ``Document`` per retrieved chunk; its
metadata holds the handle (``store_id``, ``chunk_id``, ``doc_id``, ``score``,
``n_tokens``) on top of the chunk's own metadata. ``format_modules`` turns such
documents into module references, which ``PromptCacheLLM`` serves by splicing
the chunks' cached KV instead of reading their text; ``module_prompt_template``
is the store's own RAG prompt as a LangChain template. This module knows
nothing about generation: it only names chunks.
"""

from __future__ import annotations

from collections.abc import Sequence

try:
    from langchain_core.callbacks import CallbackManagerForRetrieverRun
    from langchain_core.documents import Document
    from langchain_core.prompts import PromptTemplate
    from langchain_core.retrievers import BaseRetriever
    from pydantic import ConfigDict, Field, field_validator
except ImportError as e:  # pragma: no cover - depends on the environment
    msg = "the LangChain retriever needs langchain-core: `pip install pc-rag[langchain]`"
    raise ImportError(msg) from e

from pc_rag.errors import PCRagError
from pc_rag.rag.markers import module_ref
from pc_rag.rag.order import DEFAULT_ORDER, check_order
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.handles import ModuleHandle

__all__ = ["PromptModuleRetriever", "format_modules", "handle_document", "module_prompt_template"]


class PromptModuleRetriever(BaseRetriever):
    """The ``k`` chunks of ``store`` most similar to the query, as documents carrying their module handles.

    The documents are laid out in ``order`` (``pc_rag.rag.order``), the order ``format_modules``
    references them in. ``invoke(query, k=n)`` overrides ``k`` for one call. The handle keys
    take precedence over chunk metadata of the same name. ``Document.id`` is the
    chunk's document id, so two chunks of one document share it.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, extra="forbid")

    store: DocumentStore = Field(exclude=True)
    k: int = Field(default=4, ge=1, description="how many chunks to retrieve")
    order: str = Field(default=DEFAULT_ORDER, description="chunk layout: best-first, best-last or lost-in-the-middle")

    @field_validator("order")
    @classmethod
    def _known_order(cls, order: str) -> str:
        return check_order(order)

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun, k: int | None = None
    ) -> list[Document]:
        handles = self.store.search(query, self.k if k is None else k, self.order)
        return [handle_document(self.store, h) for h in handles]


def handle_document(store: DocumentStore, handle: ModuleHandle) -> Document:
    """``handle``'s chunk as a ``Document`` that ``format_modules`` can reference."""
    meta = {**store.handle_metadata(handle), "score": handle.score}
    return Document(page_content=handle.text, metadata=meta, id=handle.doc_id)


def format_modules(docs: Sequence[Document]) -> str:
    """Module references for ``docs`` (in order), one per line: the ``{context}`` of a cached RAG prompt.

    Raises ``PCRagError`` for a document without a handle (not from ``PromptModuleRetriever``).
    """
    refs = []
    for i, doc in enumerate(docs):
        store_id, chunk_id = doc.metadata.get("store_id"), doc.metadata.get("chunk_id")
        if not isinstance(store_id, str) or not isinstance(chunk_id, int):
            msg = (
                f"document {i} ({doc.page_content[:40]!r}) carries no prompt-module handle (metadata 'store_id' "
                "and 'chunk_id'); retrieve it with PromptModuleRetriever or PromptCacheVectorStore.as_retriever()"
            )
            raise PCRagError(msg)
        refs.append(module_ref(store_id, chunk_id))
    return "\n".join(refs)


def module_prompt_template(store: DocumentStore) -> PromptTemplate:
    """The store's RAG prompt over ``{context}`` and ``{question}``.

    Its text before ``{context}`` is the engine's preamble, so the preamble's KV is
    reused too; with ``format_modules`` as context, a chain answers exactly like
    ``PromptServer(store=store).answer(question)``.
    """
    prompt = store.engine.prompt
    preamble = prompt.preamble.replace("{", "{{").replace("}", "}}")
    return PromptTemplate.from_template(preamble + "{context}" + prompt.question_template)
