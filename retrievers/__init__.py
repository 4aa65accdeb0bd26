"""Retrievers that return prompt-module handles instead of text.

Exports are lazy: importing ``pc_rag.retrievers`` imports no framework; each name
loads its adapter module (and its framework) on first use.
"""

from __future__ import annotations

from pc_rag._lazy import lazy_exports

_EXPORTS = {
    "PromptModuleRetriever": "pc_rag.retrievers.langchain",
    "format_modules": "pc_rag.retrievers.langchain",
    "module_prompt_template": "pc_rag.retrievers.langchain",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
