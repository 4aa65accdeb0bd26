"""Persistent chunk KV: safetensors shards on disk, memory-mapped on demand, decoded spans in a byte-bounded LRU.

Layout: ``<directory>/manifest.json`` and ``<directory>/kv/<shard>.safetensors``.
A raw shard holds, for each chunk id ``c``, tensors ``"c.k"`` and ``"c.v"``
[L, H_kv, S, D] in the storage dtype and ``"c.pos"`` [S] int64 (the absolute
positions the keys were rotated at). A compressed shard (``codec``) holds
``"c.lN"``: the CacheGen bytes of the chunk at quality level N, for each level
the store writes; they carry their own positions and checksum. Every write is a new shard, moved into
place atomically, and only then listed in the manifest with its sha256 and one
per chunk (``_chunk_sums``): a crash leaves the previous store. Deleting marks
entries dead; ``compact()`` rewrites shards without them. A shard's checksum is
verified the first time it is opened in a process, outside the lock readers of
other shards need; a shard that fails it is read chunk by chunk, each chunk
checked against its own checksum, so damage loses only the chunks it touches.
Nothing is ever pickled or ``torch.load``-ed. This module knows nothing about
models, RoPE or retrieval: KV arrives finished.

Who saves the manifest: a ``KVStore`` that loaded its own saves it on every
change. Given a manifest (``DocumentStore`` passes its own), it only changes
the shard table in memory, and the owner commits it with everything else.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from pc_rag.codec import CacheGenCodec
from pc_rag.errors import CodecError, StoreCorruptedError, StoreError
from pc_rag.kv import SpanKV
from pc_rag.store._atomic import fsync_dir, fsync_file, sha256_file, staged
from pc_rag.store._chunk_sums import chunk_digest, chunk_digests, damaged_chunks
from pc_rag.store._lru import ByteLRU
from pc_rag.store._spans import check_span, span_bytes, well_shaped
from pc_rag.store._threads import map_threads
from pc_rag.store.files import SHARD_DIR, remove_unlisted
from pc_rag.store.manifest import MANIFEST_NAME, Manifest, ShardRecord

logger = logging.getLogger(__name__)

STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_LRU_BYTES = 512 << 20


class KVStore:
    """Chunk id -> ``SpanKV`` on disk, with an in-memory LRU of decoded spans on ``device``.

    ``dtype`` is the storage dtype, ``compute_dtype`` (default: ``dtype``) what
    ``get`` returns. Spans returned by ``get`` are shared with the LRU: treat
    them as read-only. ``manifest`` lets a caller share its ``Manifest`` (by
    default ``<directory>/manifest.json`` is loaded, or a new one started, and
    rewritten on every change: batch writes with ``put_many``). With ``codec`` and ``levels``, new
    shards hold each chunk compressed at every one of ``levels``; ``get`` serves ``level`` (default: the
    best a chunk has) from compressed shards and raw KV from raw ones. Thread-safe; one writer process
    at a time.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        compute_dtype: torch.dtype | None = None,
        lru_bytes: int = DEFAULT_LRU_BYTES,
        device: str | torch.device = "cpu",
        manifest: Manifest | None = None,
        codec: CacheGenCodec | None = None,
        levels: Iterable[int] = (),
        level: int | None = None,
    ) -> None:
        self.levels = tuple(sorted(set(levels)))
        if self.levels and codec is None:
            raise ValueError("compressed levels need a codec")
        for n in (*self.levels, *([level] if level is not None else [])):
            if codec is not None:
                codec.tables.level(n)  # CodecError naming the levels the tables have
        self.codec, self.level = codec, level
        if dtype not in STORAGE_DTYPES.values():
            msg = f"KV storage dtype must be one of {', '.join(STORAGE_DTYPES)}, got {dtype}"
            raise ValueError(msg)
        self.directory = Path(directory)
        self.dtype = dtype
        self.compute_dtype = compute_dtype or dtype
        self.device = torch.device(device)
        path = self.directory / MANIFEST_NAME
        self._owns_manifest = manifest is None
        self.manifest = manifest if manifest is not None else Manifest.load(path) if path.exists() else Manifest()
        self._where = self._locate()
        self._handles: dict[str, Any] = {}  # shard name -> open safe_open (mmap)
        self._lru: ByteLRU[SpanKV] = ByteLRU(lru_bytes, span_bytes)  # key: chunk id, or (chunk id, level)
        self._lock = threading.RLock()  # the shard table, handles and LRU
        self._opening: dict[str, threading.Lock] = {}  # shard name -> held while its checksum is verified
        self._suspect: set[str] = set()  # shards that failed their checksum: each chunk read is checked

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._where

    def ids(self) -> list[int]:
        return sorted(self._where)

    @property
    def nbytes(self) -> int:
        """Bytes of all shard files on disk (dead entries count until ``compact``)."""
        return sum(s.nbytes for s in self.manifest.shards.values())

    @property
    def lru_nbytes(self) -> int:
        """Bytes of decoded spans held in the LRU (at most ``lru_bytes``)."""
        return self._lru.nbytes

    @property
    def lru_bytes(self) -> int:
        return self._lru.budget

    def put(self, chunk_id: int, span: SpanKV) -> None:
        self.put_many({chunk_id: span})

    def put_many(self, spans: Mapping[int, SpanKV]) -> None:
        """Write ``spans`` as one new shard; ids already stored are replaced (their old entries marked dead)."""
        if not spans:
            return
        spans = {check_span(cid, span): span for cid, span in spans.items()}
        tensors, codec = self._tensors(spans), self._codec_name()
        with self._lock:
            name, record = self._write_shard(tensors, sorted(spans), codec, self.levels)
            shards = {n: _kill(s, spans) for n, s in self.manifest.shards.items()}
            shards[name] = record
            self._commit(shards, written=[name])
            self._forget(spans)

    def recode(
        self, codec: CacheGenCodec | None, levels: Iterable[int], *, progress: bool = True, chunks_per_shard: int = 256
    ) -> None:
        """Rewrite every live chunk into new shards, compressed with ``codec`` at ``levels`` (raw when none), and
        make them the whole shard table in one commit; on failure nothing changes. Only raw KV is re-encoded."""
        with self._lock:
            ids = self.ids()
            done = [c for c in ids if self.manifest.shards[self._where[c]].codec]
            if done:
                msg = (f"{len(done)} chunks of {self.directory} are already compressed: re-encoding them would "
                       "compound their loss; rebuild the store from its documents instead")  # fmt: skip
                raise StoreError(msg)
            before = (self.codec, self.levels)
            self.codec, self.levels = codec, tuple(sorted(set(levels)))
            try:
                self._rewrite(ids, self._read_raw, "recode", progress, chunks_per_shard)
            except BaseException:
                self.codec, self.levels = before
                raise

    def _read_raw(self, chunk_ids: list[int]) -> dict[int, SpanKV]:
        return {c: SpanKV(*self._read(self._where[c], c)) for c in chunk_ids}

    def replace_all(
        self, chunk_ids: Iterable[int], spans_of: Callable[[list[int]], Mapping[int, SpanKV]], *,
        progress: bool = True, chunks_per_shard: int = 64, desc: str = "re-encode",
    ) -> None:  # fmt: skip
        """Make the KV ``spans_of`` gives for ``chunk_ids`` (asked in that order, ``chunks_per_shard`` at a time: one
        batch's KV in memory) all this store holds: new shards (in its storage: dtype or codec levels) become the
        whole shard table in one commit, so chunks not named are dropped; on failure nothing changes. Readers keep
        the old KV until then."""
        self._rewrite(list(dict.fromkeys(chunk_ids)), spans_of, desc, progress, chunks_per_shard)

    def _rewrite(
        self, ids: list[int], spans_of: Callable[[list[int]], Mapping[int, SpanKV]], desc: str, progress: bool,
        chunks_per_shard: int,
    ) -> None:  # fmt: skip
        """Write the spans of ``ids`` as new shards and commit them as the whole shard table; on failure remove
        them. Shards are written outside the lock (they are unlisted until the commit), which takes it."""
        with self._lock:
            seq = 1 + max((int(Path(n).name.split("-")[0]) for n in self.manifest.shards), default=0)
        written: dict[str, ShardRecord] = {}
        try:
            for start in tqdm(range(0, len(ids), chunks_per_shard), desc=desc, unit="shard", disable=not progress):
                batch = ids[start : start + chunks_per_shard]
                spans = {check_span(c, span): span for c, span in spans_of(batch).items()}
                if sorted(spans) != sorted(batch):
                    msg = f"{desc}: asked for the KV of chunks {batch[:5]}..., got that of {sorted(spans)[:5]}..."
                    raise StoreError(msg)
                name, record = self._write_shard(self._tensors(spans), batch, self._codec_name(), self.levels, seq)
                written[name] = record
                seq += 1
        except BaseException:
            for name in written:
                (self.directory / name).unlink(missing_ok=True)
            raise
        with self._lock:
            retired = set(self.manifest.shards)
            self._commit(written, written=list(written))  # on failure, it removes them
            for name in retired:
                self._handles.pop(name, None)
            self._suspect &= set(written)
            self._lru.clear()
        if self._owns_manifest:
            remove_unlisted(self.directory, self.manifest.listed_files())

    def open_shards(self) -> list[str]:
        """Open (and so verify) every shard now rather than at its first read, on as many threads as torch uses;
        a line per shard that cannot be opened (its reads will raise it again)."""

        def problem(name: str) -> str | None:
            try:
                self._open(name)
            except StoreCorruptedError as e:
                return str(e)
            return None

        return [p for p in map_threads(problem, list(self.manifest.shards), "pc-rag-open") if p]

    def get(self, chunk_id: int, level: int | None = None) -> SpanKV:
        """The span of ``chunk_id`` on ``device`` in ``compute_dtype``; ``KeyError`` if absent.

        From a compressed shard: at ``level`` (default: the store's ``level``, else the best the chunk has).
        """
        where, span = self._lookup(chunk_id, level)
        return span if span is not None else self._load(chunk_id, *where)

    def _lookup(self, chunk_id: int, level: int | None) -> tuple[tuple[str, ShardRecord, Any], SpanKV | None]:
        """Where ``chunk_id`` is (shard name, record, LRU key) and its span if the LRU holds it."""
        with self._lock:
            name = self._where.get(chunk_id)
            if name is None:
                msg = f"chunk {chunk_id} is not in the KV store at {self.directory}"
                raise KeyError(msg)
            record = self.manifest.shards[name]
            key = (chunk_id, self._level_of(record, chunk_id, level)) if record.codec else chunk_id
            return (name, record, key), self._lru.get(key)

    def _load(self, chunk_id: int, name: str, record: ShardRecord, key: Any) -> SpanKV:
        """Read (and decode) ``chunk_id`` from shard ``name`` and keep it in the LRU under ``key``."""
        if record.codec:
            span = self._decode(name, record, *key)
        else:
            keys, values, positions = self._read(name, chunk_id)
            span = SpanKV(keys, values, positions)
        span = SpanKV(span.keys.to(self.device, self.compute_dtype), span.values.to(self.device, self.compute_dtype),
                      span.positions)  # fmt: skip
        with self._lock:
            if self._where.get(chunk_id) == name:  # not replaced or deleted while we read
                self._lru.put(key, span)
        return span

    def compressed_levels(self, chunk_id: int) -> tuple[int, ...]:
        """The CacheGen levels ``chunk_id`` is stored at (empty for raw KV); ``KeyError`` if absent."""
        return self._record_of(chunk_id)[1].levels

    def compressed_size(self, chunk_id: int, level: int) -> int:
        """Bytes of ``chunk_id`` at ``level``, from the shard's header (nothing is read)."""
        name, record = self._record_of(chunk_id)
        return int(self._open(name).get_slice(f"{chunk_id}.l{self._level_of(record, chunk_id, level)}").get_shape()[0])

    def compressed_bytes(self, chunk_id: int, level: int) -> bytes:
        """The CacheGen bytes of ``chunk_id`` at ``level``, undecoded (checked when decoded)."""
        name, record = self._record_of(chunk_id)
        return self._open(name).get_tensor(f"{chunk_id}.l{self._level_of(record, chunk_id, level)}").numpy().tobytes()

    def get_many(self, chunk_ids: Iterable[int]) -> list[SpanKV]:
        """``get`` for each id, in order; chunks that are not in the LRU are read and decoded on as many threads
        as torch uses (decoding releases the GIL)."""
        return [span for _, span in self.get_many_versioned(chunk_ids)]

    def get_many_versioned(self, chunk_ids: Iterable[int]) -> list[tuple[str, SpanKV]]:
        """``get_many`` with each span's version: the checksum of the shard it came from, and its level. Two spans
        of one chunk with one version are the same KV; a re-encoded or rewritten chunk gets another version."""
        chunk_ids = list(chunk_ids)
        found = [self._lookup(cid, None) for cid in chunk_ids]
        versions = [f"{record.sha256[:16]}/{cid}" + (f"@level{key[1]}" if record.codec else "")
                    for cid, ((_, record, key), _) in zip(chunk_ids, found, strict=True)]  # fmt: skip
        misses = [i for i, (_, span) in enumerate(found) if span is None]
        loaded = map_threads(lambda i: self._load(chunk_ids[i], *found[i][0]), misses, "pc-rag-kv")
        spans = [span for _, span in found]
        for i, span in zip(misses, loaded, strict=True):
            spans[i] = span
        return list(zip(versions, spans, strict=True))

    def delete(self, chunk_ids: Iterable[int]) -> int:
        """Mark ``chunk_ids`` dead (unknown ids are ignored); return how many were deleted."""
        with self._lock:
            gone = {int(c): None for c in chunk_ids if c in self._where}
            if gone:
                self._commit({n: _kill(s, gone) for n, s in self.manifest.shards.items()})
                self._forget(gone)
            return len(gone)

    def compact(self, rewrite: Iterable[str] = ()) -> int:
        """Rewrite shards holding dead entries without them, and the shards named in ``rewrite`` (a damaged one:
        its live chunks must each match their own checksum); return the bytes this frees on disk.

        Owning its manifest, the store commits and removes the retired shards and stray files; a shared
        manifest's owner does that after its own commit (the retired shards are then unlisted files).
        """
        with self._lock:
            before = self.nbytes
            shards = dict(self.manifest.shards)
            again = set(rewrite)
            retired = [n for n, s in shards.items() if s.dead or n in again]
            for name in retired:
                record = shards.pop(name)
                live = _live(record)
                if live:
                    parts = [f"l{n}" for n in record.levels] if record.codec else ["k", "v", "pos"]
                    for c in live:
                        self._check_chunk(name, c)
                    raw = {f"{c}.{t}": self._open(name).get_tensor(f"{c}.{t}") for c in live for t in parts}
                    new_name, new_record = self._write_shard(raw, live, record.codec, record.levels)
                    shards[new_name] = new_record
            self._commit(shards, written=[n for n in shards if n not in self.manifest.shards])
            for name in retired:
                self._handles.pop(name, None)
            if self._owns_manifest:
                remove_unlisted(self.directory, self.manifest.listed_files())
            return before - self.nbytes

    def reload(self, manifest: Manifest) -> None:
        """Follow the owner's newly read ``manifest``: its shard table, a fresh LRU."""
        with self._lock:
            self.manifest = manifest
            self._where = self._locate()
            self._handles = {n: h for n, h in self._handles.items() if n in self.manifest.shards}
            self._suspect &= set(self._handles)
            self._lru.clear()

    def damaged(self, name: str) -> list[int]:
        """The live chunks of shard ``name`` whose KV is lost: none if the shard matches its checksum, else those
        failing their own (every one, in a shard recorded without per-chunk checksums or that cannot be opened)."""
        record = self.manifest.shards[name]
        if self.problem(name) is None:
            return []
        live = set(_live(record))
        return [c for c in damaged_chunks(self.directory / name, record.chunk_ids, record.chunk_sha256) if c in live]

    def verify(self) -> None:
        """Check every shard against its recorded sha256; ``StoreCorruptedError`` naming each bad one."""
        problems = [p for name in sorted(self.manifest.shards) if (p := self.problem(name, hint=False))]
        if problems:
            msg = f"KV store at {self.directory} is damaged: " + "; ".join(problems) + f"; {self._repair_hint}"
            raise StoreCorruptedError(msg)

    def close(self) -> None:
        """Release open shard files and the LRU."""
        with self._lock:
            self._handles.clear()
            self._lru.clear()

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _locate(self) -> dict[int, str]:
        """Chunk id -> shard name of its live entry (later shards win, as names sort by write order)."""
        where: dict[int, str] = {}
        for name, record in sorted(self.manifest.shards.items()):
            where.update(dict.fromkeys(_live(record), name))
        return where

    def _tensors(self, spans: Mapping[int, SpanKV]) -> dict[str, torch.Tensor]:
        """What a shard holds for ``spans``: CacheGen bytes per level, or keys, values and positions."""
        tensors: dict[str, torch.Tensor] = {}
        for cid, span in spans.items():
            if self.levels:
                for n in self.levels:
                    tensors[f"{cid}.l{n}"] = torch.frombuffer(bytearray(self.codec.encode(span, n)), dtype=torch.uint8)
                continue
            tensors[f"{cid}.k"] = span.keys.detach().to("cpu", self.dtype).contiguous()
            tensors[f"{cid}.v"] = span.values.detach().to("cpu", self.dtype).contiguous()
            tensors[f"{cid}.pos"] = span.positions.detach().to("cpu", torch.int64).contiguous()
        return tensors

    def _codec_name(self) -> str:
        return f"cachegen:{self.codec.tables.digest}" if self.levels else ""

    def _write_shard(
        self, tensors: dict[str, torch.Tensor], chunk_ids: list[int], codec: str = "", levels: tuple[int, ...] = (),
        seq: int | None = None,
    ) -> tuple[str, ShardRecord]:  # fmt: skip
        """Write a new shard file atomically (temp, fsync, rename); return its name and record."""
        if seq is None:
            seq = 1 + max((int(Path(n).name.split("-")[0]) for n in self.manifest.shards), default=0)
        name = f"{SHARD_DIR}/{seq:08d}-{secrets.token_hex(4)}.safetensors"
        path = self.directory / name
        with staged(path) as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt", "pc_rag": "kv-shard/1"})
            fsync_file(tmp)
            record = ShardRecord(sha256_file(tmp), tmp.stat().st_size, tuple(chunk_ids), codec=codec, levels=levels,
                                 chunk_sha256=chunk_digests(tensors, chunk_ids))  # fmt: skip
            os.replace(tmp, path)
        fsync_dir(path.parent)
        logger.debug("wrote %s: %d chunks, %d bytes", name, len(chunk_ids), record.nbytes)
        return name, record

    def _commit(self, shards: dict[str, ShardRecord], written: Iterable[str] = ()) -> None:
        """Make ``shards`` the shard table (and save the manifest if this store owns it; on failure keep the old
        table and drop ``written``)."""
        old = dict(self.manifest.shards)
        self.manifest.shards.clear()
        self.manifest.shards.update(shards)
        try:
            if self._owns_manifest:
                self.manifest.save(self.directory / MANIFEST_NAME)
        except BaseException:
            self.manifest.shards.clear()
            self.manifest.shards.update(old)
            for name in written:
                (self.directory / name).unlink(missing_ok=True)
            raise
        self._where = self._locate()

    def _open(self, name: str) -> Any:
        """The mmap handle of shard ``name``, verifying its checksum on first open (only this shard's readers wait)."""
        with self._lock:
            handle = self._handles.get(name)
            if handle is not None:
                return handle
            opening = self._opening.setdefault(name, threading.Lock())
        with opening:
            with self._lock:
                handle = self._handles.get(name)
            if handle is not None:
                return handle
            problem = self.problem(name, hint=False)
            record = self.manifest.shards.get(name)
            if problem and not (record and record.chunk_sha256 and (self.directory / name).is_file()):
                msg = f"KV store at {self.directory} is damaged: {problem}; {self._repair_hint}"
                raise StoreCorruptedError(msg)
            try:
                handle = safe_open(str(self.directory / name), framework="pt")
            except (OSError, SafetensorError) as e:
                msg = f"KV shard {name} in {self.directory} cannot be opened: {e}; {self._repair_hint}"
                raise StoreCorruptedError(msg) from e
            if problem:
                logger.warning("%s: reading its intact chunks, each checked against its own checksum", problem)
            with self._lock:
                self._handles[name] = handle
                if problem:
                    self._suspect.add(name)
            return handle

    def problem(self, name: str, *, hint: bool = True) -> str | None:
        """What is wrong with shard ``name`` on disk, or None (``hint``: ending with the command that repairs it)."""
        path = self.directory / name
        repair = f"; {self._repair_hint}" if hint else ""
        if not path.is_file():
            return f"shard {name} is missing (restore the file{', or ' + self._repair_hint if hint else ''})"
        actual = sha256_file(path)
        record = self.manifest.shards.get(name)
        if record is None:
            return f"shard {name} is no longer listed in the manifest (the store changed; load it again)"
        if actual != record.sha256:
            return f"shard {name} does not match its checksum (sha256 {actual[:12]}…){repair}"
        return None

    @property
    def _repair_hint(self) -> str:
        return f"run `pc-rag store repair --store {self.directory}`"

    def _check_chunk(self, name: str, chunk_id: int) -> None:
        """In a shard that failed its checksum, ``StoreCorruptedError`` unless ``chunk_id`` matches its own."""
        if name not in self._suspect:
            return
        record = self.manifest.shards[name]
        if chunk_digest(self._open(name), chunk_id) != record.chunk_sha256[record.chunk_ids.index(chunk_id)]:
            msg = (f"chunk {chunk_id} in KV shard {name} of {self.directory} does not match its checksum; "
                   f"{self._repair_hint}, which encodes it again from its text")  # fmt: skip
            raise StoreCorruptedError(msg)

    def _record_of(self, chunk_id: int) -> tuple[str, ShardRecord]:
        with self._lock:
            name = self._where.get(chunk_id)
            if name is None:
                msg = f"chunk {chunk_id} is not in the KV store at {self.directory}"
                raise KeyError(msg)
            return name, self.manifest.shards[name]

    def _forget(self, chunk_ids: Iterable[int]) -> None:
        """Drop the LRU's decoded spans of ``chunk_ids``, at every level."""
        gone = set(chunk_ids)
        self._lru.pop_where(lambda key: (key[0] if isinstance(key, tuple) else key) in gone)

    def _level_of(self, record: ShardRecord, chunk_id: int, level: int | None) -> int:
        wanted = level if level is not None else self.level if self.level is not None else max(record.levels)
        if wanted not in record.levels:
            msg = f"chunk {chunk_id} is stored at CacheGen levels {list(record.levels)}, not at level {wanted}"
            raise StoreError(msg)
        return wanted

    def _decode(self, name: str, record: ShardRecord, chunk_id: int, level: int) -> SpanKV:
        if self.codec is None or record.codec != f"cachegen:{self.codec.tables.digest}":
            have = f"tables {self.codec.tables.digest}" if self.codec else "no codec tables"
            msg = f"KV shard {name} in {self.directory} was compressed as {record.codec}; this store has {have}"
            raise StoreCorruptedError(msg)
        self._check_chunk(name, chunk_id)
        try:
            blob = self._open(name).get_tensor(f"{chunk_id}.l{level}").numpy()
        except SafetensorError as e:
            msg = f"KV shard {name} lacks chunk {chunk_id} at level {level}: {e}"
            raise StoreCorruptedError(msg) from e
        try:
            return self.codec.decode(blob, dtype=self.compute_dtype)
        except CodecError as e:
            msg = f"chunk {chunk_id} (level {level}) in KV shard {name} of {self.directory}: {e}"
            raise StoreCorruptedError(msg) from e

    def _read(self, name: str, chunk_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        handle = self._open(name)
        self._check_chunk(name, chunk_id)
        try:
            keys, values, positions = (handle.get_tensor(f"{chunk_id}.{t}") for t in ("k", "v", "pos"))
        except SafetensorError as e:
            msg = f"KV shard {name} lacks the tensors of chunk {chunk_id}: {e}"
            raise StoreCorruptedError(msg) from e
        if not well_shaped(keys, values, positions):
            msg = f"KV shard {name} holds malformed tensors for chunk {chunk_id}: {tuple(keys.shape)}"
            raise StoreCorruptedError(msg)
        return keys, values, positions


def _kill(record: ShardRecord, chunk_ids: Iterable[int]) -> ShardRecord:
    """``record`` with those of ``chunk_ids`` it holds alive marked dead."""
    newly = set(_live(record)).intersection(chunk_ids)
    return replace(record, dead=tuple(sorted(newly.union(record.dead)))) if newly else record


def _live(record: ShardRecord) -> list[int]:
    dead = set(record.dead)
    return [c for c in record.chunk_ids if c not in dead]
