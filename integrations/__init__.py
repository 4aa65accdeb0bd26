"""Framework adapters (LangChain, LlamaIndex), each behind its optional extra.

Exports are lazy: importing ``pc_rag.integrations`` imports no framework; each
name loads its adapter module (and its framework) on first use. Names that both
adapters define (``PromptCacheLLM``) are imported from their submodule:
``pc_rag.integrations.llama_index`` or ``pc_rag.integrations.langchain``.
"""

from __future__ import annotations

from pc_rag._lazy import lazy_exports

_EXPORTS = {
    "PromptCacheQueryEngine": "pc_rag.integrations.llama_index",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
