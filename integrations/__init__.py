"""Framework adapters (LangChain, LlamaIndex), each behind its optional extra.

Exports are lazy: importing ``pc_rag.integrations`` imports no framework; each
name loads its adapter module (and its framework) on first use. Names that both
adapters define (``PromptCacheLLM``) are imported from their submodule:
``pc_rag.integrations.llama_index`` or ``pc_rag.integrations.langchain``.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "PromptCacheQueryEngine": "pc_rag.integrations.llama_index",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
