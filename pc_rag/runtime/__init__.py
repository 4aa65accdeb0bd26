"""The runtime below every engine: one request type, its executor, the KV it owns (pooled buffers, the shared
pool, the private arena), batched steps and the scheduler (ChunkAttention's sharing and two-phase attention).

The runtime knows nothing about PML, retrieval, stores or HTTP: the engines build ``Request`` objects and hand
them to it; the server (``pc_rag.server``) sits above the engines. Exports are lazy.
"""

from __future__ import annotations

from pc_rag._lazy import lazy_exports

_EXPORTS = {
    "Request": "pc_rag.runtime.request",
    "Scheduler": "pc_rag.runtime.scheduler",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
