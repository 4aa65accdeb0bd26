"""Chunk KV kept in a module store (Redis, a shared directory) under content-addressed keys.

The manifest lists each chunk's content hash; a key adds the model fingerprint and the store's encoding
(``pc_rag.modules.keys``), so stores built the same way share modules and no other store ever reads them.
Decoded spans stay in a byte-bounded LRU. A module that is missing (evicted, flushed) or a backend that is
unreachable raises a ``ModuleStoreError`` naming the chunk, or, given ``recompute``, the chunk is encoded
again from its text: never other KV. A store never deletes modules, since other stores may share them;
expire them on the backend (Redis ``maxmemory-policy``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace

import torch

from pc_rag.codec import CacheGenCodec
from pc_rag.errors import ModuleCorruptedError, ModuleStoreError, ModuleStoreUnavailableError, StoreError
from pc_rag.kv import SpanKV
from pc_rag.modules.interface import ModuleStore
from pc_rag.modules.keys import Encoding, ModuleKey
from pc_rag.modules.serialize import module_bytes, module_span
from pc_rag.store._lru import ByteLRU
from pc_rag.store._spans import span_bytes
from pc_rag.store._threads import map_threads
from pc_rag.store.manifest import Manifest

Recompute = Callable[[Sequence[int]], list[SpanKV]]  # chunk ids -> their KV, encoded from the manifest's text
RECOMPUTED = "recomputed"  # the version of KV encoded again at read time


class ModuleKV:
    """Chunk id -> ``SpanKV`` through ``modules`` (which this object closes), for the chunks ``manifest`` lists.

    ``encoding`` names how the store encodes (its ``storage`` is the raw dtype's name; compressed levels
    replace it per level). With ``codec`` and ``levels``, each chunk is written at every level and read at the
    highest. Thread-safe.
    """

    def __init__(
        self,
        modules: ModuleStore,
        manifest: Manifest,
        model_fingerprint: str,
        encoding: Encoding,
        *,
        dtype: torch.dtype,
        compute_dtype: torch.dtype,
        device: str | torch.device = "cpu",
        codec: CacheGenCodec | None = None,
        levels: Iterable[int] = (),
        lru_bytes: int,
        recompute: Recompute | None = None,
    ) -> None:
        self.modules, self.manifest, self.fingerprint, self.encoding = modules, manifest, model_fingerprint, encoding
        self.dtype, self.compute_dtype, self.device = dtype, compute_dtype, torch.device(device)
        self.codec, self.levels = codec, tuple(sorted(set(levels)))
        if self.levels and codec is None:
            raise ValueError("compressed levels need a codec")
        self.level = max(self.levels, default=None)  # the level reads decode; None: raw KV
        self.recompute = recompute
        self._lru: ByteLRU[SpanKV] = ByteLRU(lru_bytes, span_bytes)
        self._lock = threading.Lock()

    def key(self, content_hash: str, level: int | None = None) -> str:
        """The module key of a chunk's content at ``level`` (raw KV: no level)."""
        storage = f"cachegen:{self.codec.tables.digest}:{level}" if level is not None else self.encoding.storage
        return ModuleKey(self.fingerprint, replace(self.encoding, storage=storage), content_hash).name

    def _keys(self, content_hash: str) -> list[str]:
        return [self.key(content_hash, n) for n in self.levels] if self.levels else [self.key(content_hash)]

    def put_many(self, spans: Mapping[str, SpanKV]) -> None:
        """Write the KV of each content hash in ``spans`` (at every level), in one batch."""
        items: dict[str, bytes] = {}
        for content, span in spans.items():
            for n, key in zip(self.levels or (None,), self._keys(content), strict=True):
                items[key] = module_bytes(span, dtype=self.dtype, codec=self.codec if n is not None else None,
                                          level=n or 0)  # fmt: skip
        self.modules.put_many(items)

    def missing(self, content_hashes: Sequence[str]) -> list[str]:
        """Those of ``content_hashes`` that lack a module at some level (what encoding still has to write)."""
        keys = [self._keys(h) for h in content_hashes]
        present = iter(self.modules.contains_many([k for ks in keys for k in ks]))
        return [h for h, ks in zip(content_hashes, keys, strict=True) if not all([next(present) for _ in ks])]

    def get_many_versioned(self, chunk_ids: Iterable[int]) -> list[tuple[str, SpanKV]]:
        """Each chunk's (version, KV) in order; the version is its module key (or ``recomputed``)."""
        chunk_ids = list(chunk_ids)
        keys = [self.key(self._content(cid), self.level) for cid in chunk_ids]
        with self._lock:
            spans: list[SpanKV | None] = [self._lru.get(key) for key in keys]
        misses = [i for i, span in enumerate(spans) if span is None]
        try:
            values = self.modules.get_many([keys[i] for i in misses])
        except ModuleStoreUnavailableError:
            if self.recompute is None:
                raise
            return self._recomputed(chunk_ids, keys, spans, misses)
        absent = [i for i, v in zip(misses, values, strict=True) if v is None]
        if absent and self.recompute is None:
            cid = chunk_ids[absent[0]]
            msg = (f"the module of chunk {cid} (and {len(absent) - 1} more) is missing from the module store at "
                   f"{self.modules.url} (evicted or flushed?): re-index, or load with recompute_missing")  # fmt: skip
            raise ModuleStoreError(msg)
        found = [(i, v) for i, v in zip(misses, values, strict=True) if v is not None]
        decoded = map_threads(lambda item: self._decoded(chunk_ids[item[0]], keys[item[0]], item[1]), found,
                              "pc-rag-modules")  # fmt: skip
        for (i, _), span in zip(found, decoded, strict=True):
            spans[i] = span
        if absent:
            return self._recomputed(chunk_ids, keys, spans, absent)
        return list(zip(keys, spans, strict=True))  # type: ignore[arg-type]

    def _decoded(self, chunk_id: int, key: str, value: bytes) -> SpanKV:
        span = module_span(value, key, dtype=self.compute_dtype, codec=self.codec if self.level is not None else None)
        n_tokens = self.manifest.chunks[chunk_id].n_tokens
        if span.length != n_tokens or span.keys.shape[0] == 0:
            msg = f"module {key} holds {span.length} tokens; chunk {chunk_id} has {n_tokens}"
            raise ModuleCorruptedError(msg)
        span = SpanKV(span.keys.to(self.device), span.values.to(self.device), span.positions)
        with self._lock:
            self._lru.put(key, span)
        return span

    def _recomputed(
        self, chunk_ids: list[int], keys: list[str], spans: list[SpanKV | None], todo: list[int]
    ) -> list[tuple[str, SpanKV]]:
        """Fill ``todo`` by encoding those chunks again from their text (not kept: the backend may recover)."""
        assert self.recompute is not None
        for i, span in zip(todo, self.recompute([chunk_ids[i] for i in todo]), strict=True):
            spans[i] = span
        redone = set(todo)
        versions = [f"{RECOMPUTED}/{key}" if i in redone else key for i, key in enumerate(keys)]
        return list(zip(versions, spans, strict=True))  # type: ignore[arg-type]

    def _content(self, chunk_id: int) -> str:
        record = self.manifest.chunks.get(chunk_id)
        if record is None or not record.content_hash:
            msg = f"chunk {chunk_id} has no module in this store (unknown chunk, or written without a content hash)"
            raise StoreError(msg)
        return record.content_hash

    def missing_chunks(self) -> list[int]:
        """Chunks of the manifest whose module the backend lacks."""
        ids = sorted(self.manifest.chunks)
        lost = set(self.missing([self.manifest.chunks[c].content_hash for c in ids]))
        return [c for c in ids if self.manifest.chunks[c].content_hash in lost]

    def ids(self) -> list[int]:
        return sorted(self.manifest.chunks)

    @property
    def nbytes(self) -> int:
        """Bytes kept in this directory: none (modules live in the module store)."""
        return 0

    def delete(self, chunk_ids: Iterable[int]) -> int:
        """Count the known ``chunk_ids`` and drop every decoded span (the LRU is keyed by module, not chunk); the
        modules stay: other stores may share them."""
        gone = [c for c in chunk_ids if c in self.manifest.chunks]
        with self._lock:
            self._lru.clear()
        return len(gone)

    def compact(self) -> int:
        """Nothing to rewrite: the store holds no shards."""
        return 0

    def writer_for(self, encoding: Encoding) -> ModuleKV:
        """A writer of this store's modules (same backend, model, storage and codec) under another ``encoding``,
        e.g. a re-encoding's before it commits; closing it would close the shared backend: let it go instead."""
        return ModuleKV(
            self.modules, self.manifest, self.fingerprint, encoding, dtype=self.dtype,
            compute_dtype=self.compute_dtype, codec=self.codec, levels=self.levels, lru_bytes=0,
        )  # fmt: skip

    def use_encoding(self, encoding: Encoding) -> None:
        """Read modules of ``encoding`` from now on (the store was re-encoded into them)."""
        with self._lock:
            self.encoding = encoding
            self._lru.clear()

    def recode(self, *args: object, **kwargs: object) -> None:
        msg = f"a store whose KV lives in {self.modules.url} cannot be recompressed in place: index into a new store"
        raise StoreError(msg)

    def reload(self, manifest: Manifest) -> None:
        with self._lock:
            self.manifest = manifest
            self._lru.clear()

    def close(self) -> None:
        with self._lock:
            self._lru.clear()
        self.modules.close()
