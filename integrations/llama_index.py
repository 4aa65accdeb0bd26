"""LlamaIndex adapter: an LLM that serves prompt modules and a query engine that keeps handles to it.

``PromptCacheLLM`` (``llama_index_llm``) is a ``CustomLLM`` over the shared
``PromptServer``; ``PromptCacheQueryEngine`` (``llama_index_query``) retrieves
with ``pc_rag.retrievers.llama_index.PromptModuleRetriever`` and answers from
the chunks' cached KV. Needs ``pip install pc-rag[llamaindex]``. This module
only re-exports.
"""

from __future__ import annotations

from pc_rag.integrations.llama_index_llm import PromptCacheLLM
from pc_rag.integrations.llama_index_query import PromptCacheQueryEngine, module_qa_template
from pc_rag.retrievers.llama_index import PromptModuleRetriever

__all__ = ["PromptCacheLLM", "PromptCacheQueryEngine", "PromptModuleRetriever", "module_qa_template"]
