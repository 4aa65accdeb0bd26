"""A module store from its address: ``redis://`` / ``rediss://`` / ``unix://`` for Redis, ``file://`` or a
path for a directory."""

from __future__ import annotations

from urllib.parse import urlparse

from pc_rag.modules.interface import ModuleStore


def open_module_store(address: str) -> ModuleStore:
    """The backend ``address`` names; ``ValueError`` for an address of no known kind."""
    scheme = urlparse(address).scheme
    if scheme in ("redis", "rediss", "unix"):
        from pc_rag.modules.redis_store import RedisModuleStore

        return RedisModuleStore(address)
    if scheme in ("file", ""):
        from pc_rag.modules.local_store import LocalModuleStore

        return LocalModuleStore(urlparse(address).path if scheme else address)
    msg = f"module store address {address!r}: use redis://host:port/db, rediss://, unix://, file:///dir or a path"
    raise ValueError(msg)
