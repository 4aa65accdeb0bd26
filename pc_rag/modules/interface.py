"""The module-store interface: bytes of one module (compressed CacheGen bytes, or raw KV as safetensors) by key.

Values are opaque here; each is framed with a checksum by the backend (``framing``), so a damaged value is
refused, never returned as KV. Batched variants take and return keys in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class ModuleStore(Protocol):
    """Module bytes by key (``ModuleKey.name``), at the address ``url``. Thread-safe; ``close`` releases
    connections or files."""

    url: str

    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None:
        """The value, or None when the key is absent."""
        ...

    def contains(self, key: str) -> bool: ...

    def delete(self, key: str) -> bool:
        """Whether the key was there."""
        ...

    def put_many(self, items: Mapping[str, bytes]) -> None: ...

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def contains_many(self, keys: Sequence[str]) -> list[bool]: ...

    def delete_many(self, keys: Iterable[str]) -> int:
        """How many of the keys were there."""
        ...

    def close(self) -> None: ...
