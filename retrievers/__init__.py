"""Retrievers that return prompt-module handles instead of text.

Exports are lazy: importing ``pc_rag.retrievers`` imports no framework; each name
loads its adapter module (and its framework) on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "PromptModuleRetriever": "pc_rag.retrievers.langchain",
    "format_modules": "pc_rag.retrievers.langchain",
    "module_prompt_template": "pc_rag.retrievers.langchain",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        msg = f"module {__name__!r} has no attribute {name!r}"
        raise AttributeError(msg)
    return getattr(import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
