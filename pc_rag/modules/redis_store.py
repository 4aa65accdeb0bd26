"""Module KV in Redis: one value per module key, framed with a checksum, shared by every process that points
at the same server.

Needs the ``redis`` client (``pip install 'pc-rag[scaleout]'``). Failures surface as ``ModuleStoreError``s
naming the server: unreachable (stopped, restarting) as ``ModuleStoreUnavailableError``, out of memory
(``maxmemory`` with ``noeviction``) as ``ModuleStoreFullError``. A batched write is one ``MSET``: all
of it lands, or none.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from pc_rag.errors import ModuleStoreError, ModuleStoreFullError, ModuleStoreUnavailableError
from pc_rag.modules.framing import frame, unframe


class RedisModuleStore:
    """``ModuleStore`` on a Redis server at ``url`` (``redis://host:port/db``)."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        try:
            import redis
        except ImportError as e:
            msg = "the Redis module store needs the redis client: pip install 'pc-rag[scaleout]'"
            raise ModuleStoreError(msg) from e
        self.url = url
        self._redis = redis
        self._client: Any = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def put(self, key: str, value: bytes) -> None:
        self.put_many({key: value})

    def get(self, key: str) -> bytes | None:
        return self.get_many([key])[0]

    def contains(self, key: str) -> bool:
        return self.contains_many([key])[0]

    def delete(self, key: str) -> bool:
        return self.delete_many([key]) == 1

    def put_many(self, items: Mapping[str, bytes]) -> None:
        if not items:
            return
        with self._errors("write"):
            self._client.mset({key: frame(value) for key, value in items.items()})

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        with self._errors("read"):
            values = self._client.mget(list(keys))
        return [None if v is None else unframe(v, key) for key, v in zip(keys, values, strict=True)]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        with self._errors("read"):
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return [bool(n) for n in pipe.execute()]

    def delete_many(self, keys: Iterable[str]) -> int:
        keys = list(keys)
        if not keys:
            return 0
        with self._errors("delete"):
            return int(self._client.delete(*keys))

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RedisModuleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        """Redis's exceptions as ``ModuleStoreError``s that name the server and what was being done."""
        errors = self._redis.exceptions
        try:
            yield
        except (errors.ConnectionError, errors.TimeoutError) as e:
            msg = f"the Redis module store at {self.url} is unreachable ({what}): {e}"
            raise ModuleStoreUnavailableError(msg) from e
        except errors.ResponseError as e:
            if isinstance(e, errors.OutOfMemoryError):
                msg = f"the Redis module store at {self.url} is out of memory; nothing was written: {e}"
                raise ModuleStoreFullError(msg) from e
            msg = f"the Redis module store at {self.url} refused a {what}: {e}"
            raise ModuleStoreError(msg) from e
