"""LlamaIndex query engine that hands retrieved modules, not their text, to the LLM.

``PromptCacheQueryEngine`` retrieves nodes carrying prompt-module handles,
formats them as module references in a prompt whose text before the references
is the store's preamble and whose text after is its question template, and
answers through ``PromptCacheLLM``: the store splices the chunks' cached KV, so
only the question (and the recovery mode's tokens) is computed. The stock
``RetrieverQueryEngine`` also works with these parts, but sends chunk text, which
is served correctly by full prefill. This module knows nothing about KV: it
builds prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

try:
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.base.response.schema import Response, StreamingResponse
    from llama_index.core.bridge.pydantic import Field, model_validator
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
    from llama_index.core.prompts.mixin import PromptDictType
    from llama_index.core.query_engine import CustomQueryEngine
    from llama_index.core.schema import NodeWithScore, QueryBundle
except ImportError as e:  # pragma: no cover - depends on the environment
    msg = "the LlamaIndex adapter needs llama-index-core: `pip install pc-rag[llamaindex]`"
    raise ImportError(msg) from e

from pc_rag.errors import PCRagError
from pc_rag.integrations.llama_index_llm import PromptCacheLLM
from pc_rag.rag.order import DEFAULT_ORDER
from pc_rag.retrievers.llama_index import PromptModuleRetriever, node_handle
from pc_rag.store.document_store import DocumentStore

__all__ = ["PromptCacheQueryEngine", "module_qa_template"]

STATS_KEY = "generation_stats"  # where a response's metadata holds TTFT and token counts


def module_qa_template(store: DocumentStore) -> PromptTemplate:
    """The store's RAG prompt with ``{context_str}`` where the module references go and ``{query_str}``.

    Its text before ``{context_str}`` is the store's preamble, so the preamble's cached
    KV (which the chunks were encoded after) is reused.
    """
    prompt = store.engine.prompt
    return PromptTemplate(
        prompt.preamble + "{context_str}" + prompt.question_template.replace("{question}", "{query_str}")
    )


class PromptCacheQueryEngine(CustomQueryEngine):
    """Retrieve module handles, answer from their cached KV; ``streaming=True`` returns a ``StreamingResponse``.

    A response's ``metadata`` maps each source node id to its metadata, as LlamaIndex's
    synthesizers do, and ``"generation_stats"`` to the reply's stats (for a streaming
    response, filled in when the stream ends).
    """

    retriever: BaseRetriever = Field(description="Returns nodes carrying module handles (PromptModuleRetriever).")
    llm: PromptCacheLLM = Field(description="Serves the module-reference prompt from the retriever's store.")
    qa_template: BasePromptTemplate = Field(
        description="Prompt with {context_str} (the module references) and {query_str}; default: the store's."
    )
    node_postprocessors: list[BaseNodePostprocessor] = Field(
        default_factory=list, description="Applied to retrieved nodes before they are referenced."
    )
    streaming: bool = Field(default=False, description="Return a StreamingResponse of text deltas.")

    @model_validator(mode="after")
    def _llm_serves_a_store(self) -> PromptCacheQueryEngine:
        store = self.llm.store
        if store is None:
            msg = "PromptCacheQueryEngine needs an LLM that serves a DocumentStore (PromptCacheLLM.from_store)"
            raise PCRagError(msg)
        if isinstance(self.retriever, PromptModuleRetriever) and self.retriever.store.store_id != store.store_id:
            msg = f"the retriever searches store {self.retriever.store.store_id}, but the LLM serves {store.store_id}"
            raise PCRagError(msg)
        return self

    @classmethod
    def from_store(
        cls,
        store: DocumentStore,
        similarity_top_k: int = 5,
        *,
        mode: str | None = None,
        order: str = DEFAULT_ORDER,
        streaming: bool = False,
        qa_template: BasePromptTemplate | None = None,
        **settings: Any,
    ) -> PromptCacheQueryEngine:
        """Retriever and LLM over ``store``: recovery ``mode``, chunk ``order``, ``PromptCacheLLM`` ``settings``."""
        return cls(
            retriever=PromptModuleRetriever(store, similarity_top_k, order=order),
            llm=PromptCacheLLM.from_store(store, mode, **settings),
            qa_template=qa_template or module_qa_template(store),
            streaming=streaming,
        )

    @property
    def store(self) -> DocumentStore:
        store = self.llm.store
        assert store is not None, "checked at construction"
        return store

    def retrieve(self, query_str: str) -> list[NodeWithScore]:
        """Retrieved nodes after the postprocessors."""
        bundle = QueryBundle(query_str)
        nodes = self.retriever.retrieve(bundle)
        for postprocessor in self.node_postprocessors:
            nodes = postprocessor.postprocess_nodes(nodes, query_bundle=bundle)
        return nodes

    def prompt(self, query_str: str, nodes: list[NodeWithScore]) -> str:
        """``qa_template`` with ``nodes`` as module references (adjacent, in retrieval order)."""
        refs = "".join(self.store.module_ref(node_handle(self.store, n)) for n in nodes)
        return self.qa_template.format(context_str=refs, query_str=query_str)

    def custom_query(self, query_str: str) -> Response | StreamingResponse:
        nodes = self.retrieve(query_str)
        prompt = self.prompt(query_str, nodes)  # laid out in the retriever's order
        metadata: dict[str, Any] = {n.node.node_id: n.node.metadata for n in nodes}
        ranked = best_first(nodes)  # sources as a reader expects them, whatever the layout
        if self.streaming:
            return StreamingResponse(_deltas(self.llm, prompt, metadata), source_nodes=ranked, metadata=metadata)
        reply = self.llm.complete(prompt, formatted=True)
        return Response(reply.text, source_nodes=ranked, metadata=metadata | {STATS_KEY: reply.additional_kwargs})

    def _get_prompts(self) -> PromptDictType:
        return {"qa_template": self.qa_template}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        if "qa_template" in prompts_dict:
            self.qa_template = prompts_dict["qa_template"]


def best_first(nodes: list[NodeWithScore]) -> list[NodeWithScore]:
    """``nodes`` by score, highest first (unscored last; ties keep their order)."""
    return sorted(nodes, key=lambda n: -n.score if n.score is not None else float("inf"))


def _deltas(llm: PromptCacheLLM, prompt: str, metadata: dict[str, Any]) -> Iterator[str]:
    """Text deltas of the reply; the stats land in ``metadata`` when the stream ends."""
    for response in llm.stream_complete(prompt, formatted=True):
        if response.delta:
            yield response.delta
        if response.additional_kwargs:
            metadata[STATS_KEY] = response.additional_kwargs
