"""Serving: one request type and executor, KV shared across requests (ChunkAttention), batched decoding, the
scheduler, and ``PromptServer``, which answers from a store or a Prompt Cache.

Exports are lazy: the engines import ``serving.executor`` without loading the server stack.
"""

from __future__ import annotations

from pc_rag._lazy import lazy_exports

_EXPORTS = {
    "Answer": "pc_rag.serving.prompt_server",
    "PromptServer": "pc_rag.serving.prompt_server",
    "Request": "pc_rag.serving.request",
    "Scheduler": "pc_rag.serving.scheduler",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
