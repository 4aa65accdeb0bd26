"""The server above the engines: ``PromptServer`` (answers from a store or a Prompt Cache), its HTTP app and
the OpenAI-compatible API. It builds requests through the engines and never runs the model itself.

Exports are lazy.
"""

from __future__ import annotations

from pc_rag._lazy import lazy_exports

_EXPORTS = {
    "Answer": "pc_rag.server.prompt_server",
    "PromptServer": "pc_rag.server.prompt_server",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
