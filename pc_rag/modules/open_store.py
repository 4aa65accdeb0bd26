"""A module store from its address: ``redis://`` / ``rediss://`` / ``unix://`` for Redis, ``file://`` or a
path for a directory."""

from __future__ import annotations

from urllib.parse import urlparse

from pc_rag.errors import ModuleStoreError
from pc_rag.modules.interface import ModuleStore

REDIS_SCHEMES = ("redis", "rediss", "unix")


def check_module_address(address: str) -> str:
    """The backend kind ``address`` names (``redis`` or ``directory``); ``ModuleStoreError`` for another."""
    scheme = urlparse(address).scheme
    if scheme in REDIS_SCHEMES:
        return "redis"
    if scheme in ("file", "") and address.strip():
        return "directory"
    msg = f"module store address {address!r}: use redis://host:port/db, rediss://, unix://, file:///dir or a path"
    raise ModuleStoreError(msg)


def open_module_store(address: str) -> ModuleStore:
    """The backend ``address`` names."""
    if check_module_address(address) == "redis":
        from pc_rag.modules.redis_store import RedisModuleStore

        return RedisModuleStore(address)
    from pc_rag.modules.local_store import LocalModuleStore

    parsed = urlparse(address)
    return LocalModuleStore(parsed.path if parsed.scheme else address)
