"""Where module KV lives: a small interface (``ModuleStore``) with backends, keyed so that two stores never
exchange KV that was made differently (``ModuleKey``). Backends are imported on use (Redis needs ``redis``)."""

from __future__ import annotations

from pc_rag._lazy import lazy_exports

_EXPORTS = {
    "LocalModuleStore": "pc_rag.modules.local_store",
    "ModuleKey": "pc_rag.modules.keys",
    "ModuleStore": "pc_rag.modules.interface",
    "RedisModuleStore": "pc_rag.modules.redis_store",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
