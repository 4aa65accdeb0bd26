"""Loading compressed chunks from a slower tier, adapting the level to the link (CacheGen section 5.3).

A ``ChunkSource`` serves a chunk's bytes at each level it holds (CacheGen levels, and ``RAW`` where it
keeps uncompressed KV). ``AdaptiveLoader`` fetches the chunks a query needs one after another while
earlier ones decode on worker threads; before each fetch it estimates the link's throughput and the
decoding cost from what it just measured and picks the best level that still fits the chunk's share of
the TTFT target, or ``TEXT`` (recompute the chunk from its tokens) when that is cheaper than the lightest
level. ``Throttled`` puts a bandwidth limit on any source, to test and measure this; a clock can be
injected so tests need not sleep. This module knows nothing about models: recomputing is the caller's."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from pc_rag.codec import CacheGenCodec
from pc_rag.kv import SpanKV
from pc_rag.store.kvstore import KVStore

TEXT = "text"
RAW = 0  # a source's uncompressed KV, where it keeps it


class ChunkSource(Protocol):
    def levels(self, chunk_id: int) -> tuple[int, ...]: ...

    def size(self, chunk_id: int, level: int) -> int: ...

    def read(self, chunk_id: int, level: int) -> bytes: ...


class StoreSource:
    """A ``KVStore``'s compressed chunks as a ``ChunkSource``."""

    def __init__(self, store: KVStore) -> None:
        self.store = store

    def levels(self, chunk_id: int) -> tuple[int, ...]:
        return self.store.compressed_levels(chunk_id)

    def size(self, chunk_id: int, level: int) -> int:
        return self.store.compressed_size(chunk_id, level)

    def read(self, chunk_id: int, level: int) -> bytes:
        return self.store.compressed_bytes(chunk_id, level)


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class Throttled:
    """``source`` read through a link of ``bytes_per_s`` (plus ``latency_s`` per read)."""

    def __init__(self, source: ChunkSource, bytes_per_s: float, latency_s: float = 0.0, clock: Clock | None = None):
        if bytes_per_s <= 0:
            raise ValueError(f"bandwidth must be positive, got {bytes_per_s}")
        self.source, self.bytes_per_s, self.latency_s = source, bytes_per_s, latency_s
        self.clock = clock or WallClock()

    def levels(self, chunk_id: int) -> tuple[int, ...]:
        return self.source.levels(chunk_id)

    def size(self, chunk_id: int, level: int) -> int:
        return self.source.size(chunk_id, level)

    def read(self, chunk_id: int, level: int) -> bytes:
        start = self.clock.now()
        data = self.source.read(chunk_id, level)
        self.clock.sleep(max(0.0, self.latency_s + len(data) / self.bytes_per_s - (self.clock.now() - start)))
        return data


@dataclass(frozen=True)
class Loaded:
    """What the loader did for one chunk: the ``level`` (``RAW``, a CacheGen level or ``TEXT``), bytes fetched, the
    seconds from the start of its fetch to the end of its decoding, and the decoded ``span`` (None for ``TEXT``)."""

    chunk_id: int
    level: int | str
    nbytes: int
    seconds: float
    span: SpanKV | None


class AdaptiveLoader:
    """Picks a level per chunk to meet ``ttft_target_s``; costs per token in seconds for decoding and recomputing.

    Fetching is sequential (one link); decoding runs on ``workers`` threads while the next chunk is fetched,
    so a chunk costs about the larger of its transfer and its decoding shared by the workers. Both estimates
    follow what was measured: the link's throughput from the previous fetch, the decoding cost per token from
    the previous decode. ``RAW`` (level 0), where the source has it, is the best level and costs no decoding;
    ``decode(chunk_id, level, data)`` turns what was fetched into a span (default: the codec, for CacheGen levels).
    """

    def __init__(
        self, source: ChunkSource, codec: CacheGenCodec, *, ttft_target_s: float, decode_s_per_token: float,
        recompute_s_per_token: float, initial_bytes_per_s: float, clock: Clock | None = None,
        decode: Callable[[int, int, bytes], SpanKV] | None = None, workers: int = 2,
    ) -> None:  # fmt: skip
        self.source, self.codec, self.target = source, codec, ttft_target_s
        self.decode_cost, self.recompute_cost = decode_s_per_token, recompute_s_per_token
        self.bytes_per_s = initial_bytes_per_s
        self.clock = clock or WallClock()
        self._decode = decode or self._decode_cachegen
        self.workers = workers

    def load(self, chunks: Sequence[tuple[int, int]]) -> list[Loaded]:
        """Fetch ``chunks`` ((chunk id, tokens), in order) and decode them, or mark them ``TEXT``."""
        start, out = self.clock.now(), []
        with ThreadPoolExecutor(self.workers, thread_name_prefix="pc-rag-decode") as pool:
            for i, (chunk_id, tokens) in enumerate(chunks):
                share = max(0.0, self.target - (self.clock.now() - start)) / (len(chunks) - i)
                choice = self.choose(chunk_id, tokens, share)
                if choice == TEXT:
                    out.append(Loaded(chunk_id, TEXT, 0, 0.0, None))
                    continue
                began = self.clock.now()
                data = self.source.read(chunk_id, choice)
                self.bytes_per_s = len(data) / max(self.clock.now() - began, 1e-9)  # the estimate for the next chunk
                out.append(pool.submit(self._decoded, chunk_id, choice, data, tokens, began))
            return [x if isinstance(x, Loaded) else x.result() for x in out]

    def choose(self, chunk_id: int, tokens: int, budget_s: float) -> int | str:
        """The best level whose estimated cost fits ``budget_s``; else the cheapest of the lightest level and
        recomputing the chunk's text."""
        levels = sorted(self.source.levels(chunk_id), key=lambda n: (n == RAW, n), reverse=True)  # best first
        costs = {n: self.cost(chunk_id, n, tokens) for n in levels}
        fitting = [n for n in levels if costs[n] <= budget_s]
        if fitting:
            return fitting[0]
        lightest = min(levels, key=costs.__getitem__)
        return TEXT if tokens * self.recompute_cost < costs[lightest] else lightest

    def cost(self, chunk_id: int, level: int, tokens: int) -> float:
        """Estimated seconds the chunk adds at ``level``: its transfer or its share of decoding, the larger."""
        transfer = self.source.size(chunk_id, level) / self.bytes_per_s
        return transfer if level == RAW else max(transfer, tokens * self.decode_cost / self.workers)

    def _decoded(self, chunk_id: int, level: int, data: bytes, tokens: int, began: float) -> Loaded:
        # Decoding is real work on this machine: timed by the wall, not by ``clock``, which the fetches on the
        # loading thread advance meanwhile (a simulated link moves an injected clock while this thread decodes).
        decode_began = time.perf_counter()
        span = self._decode(chunk_id, level, data)
        if level != RAW and tokens:
            self.decode_cost = (time.perf_counter() - decode_began) / tokens  # the estimate for the next chunk
        return Loaded(chunk_id, level, len(data), self.clock.now() - began, span)

    def _decode_cachegen(self, chunk_id: int, level: int, data: bytes) -> SpanKV:
        if level == RAW:
            raise ValueError(f"chunk {chunk_id}: this loader has no decoder for raw KV (pass decode=)")
        return self.codec.decode(data)
