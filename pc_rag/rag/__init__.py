"""Retrieval-augmented answering from chunk modules: prompt, recovery modes, engine.

Exports are lazy: importing a light submodule (``markers``, ``modes``, ``order``, ``chunk``) does not load the
engine and the serving stack behind it.
"""

from __future__ import annotations

from pc_rag._lazy import lazy_exports

_EXPORTS = {
    "MODES": "pc_rag.rag.modes",
    "Chunk": "pc_rag.rag.chunk",
    "RagEngine": "pc_rag.rag.engine",
    "RagPrompt": "pc_rag.rag.prompt",
    "RecoveryMode": "pc_rag.rag.modes",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
