"""One copy of shared KV for all live requests: segments of fixed-size chunks in a preallocated pool (ChunkAttention).

A segment is a span's KV as requests import it (a preamble, a module at its positions), stored once in
``[L, H_kv, chunks * C, D]`` pool tensors, in whole chunks of ``C`` tokens (the paper uses 64), consecutive so
that one attention pass reads it. ChunkAttention keys its chunks by their path in a prefix tree; Prompt Cache
modules have the same KV wherever they are imported at the same positions, so a segment is keyed by what made
its KV (``source``), its tokens and its absolute positions: literal prefixes are shared, and so are identical
modules after different ones. Requests ``acquire`` a segment (inserted on first use) and ``release`` it when
they finish; a segment no request holds stays cached until its chunks are needed, least recently used first.
When live segments fill it, the pool grows (doubling, up to ``max_chunks``): a request's part that found no room
used to stay in its private arena row, which cost more memory (a copy per request) and made every decode step
read it once per row. Views of the pool (``span``, ``view``) are valid until the next ``acquire``. This module
knows nothing about models, prompts or attention.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from pc_rag.errors import KVPoolFullError
from pc_rag.kv import SpanKV

CHUNK_TOKENS = 64


@dataclass(frozen=True)
class SegmentKey:
    """What makes two spans' KV interchangeable: the ``source`` that made it (the model and the encoding, e.g. a
    schema's span or a store's preamble), its tokens and their absolute positions."""

    source: str
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]


@dataclass(eq=False)
class Segment:
    """A segment's place in the pool: tokens ``start:start + length`` of every layer; ``holders`` live requests."""

    key: SegmentKey
    first_chunk: int
    chunks: int
    length: int
    holders: int = 0

    @property
    def start(self) -> int:
        return self.first_chunk * CHUNK_TOKENS

    @property
    def end(self) -> int:
        """One past its last token in the pool (its last chunk may have room after it)."""
        return self.start + self.length

    def follows(self, other: Segment) -> bool:
        """Whether this segment's chunks come right after ``other``'s in the pool."""
        return self.first_chunk == other.first_chunk + other.chunks


class SharedKVPool:
    """Fixed-size chunks of shared KV; thread-safe. ``chunks`` of ``CHUNK_TOKENS`` tokens each, allocated up front;
    when live segments fill them, more, up to ``max_chunks`` (default: ``chunks``, a fixed size)."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, *, chunks: int, max_chunks: int | None = None,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        if chunks < 1:
            raise ValueError(f"a pool needs at least one chunk, got {chunks}")
        if max_chunks is not None and max_chunks < chunks:
            raise ValueError(f"a pool of {chunks} chunks cannot grow to at most {max_chunks}")
        shape = (layers, kv_heads, chunks * CHUNK_TOKENS, head_dim)
        self.keys = torch.empty(shape, dtype=dtype, device=device)  # [L, H_kv, chunks * C, D]
        self.values = torch.empty(shape, dtype=dtype, device=device)
        self.chunks = chunks
        self.max_chunks = chunks if max_chunks is None else max_chunks
        self._free: list[tuple[int, int]] = [(0, chunks)]  # runs of free chunks (first, count), by first
        self._segments: dict[SegmentKey, Segment] = {}
        self._idle: OrderedDict[SegmentKey, None] = OrderedDict()  # held by no request, least recently used first
        self._lock = threading.Lock()

    @property
    def chunk_bytes(self) -> int:
        """Bytes of keys and values one chunk holds."""
        return 2 * self.keys[:, :, :CHUNK_TOKENS].nbytes

    def acquire(self, key: SegmentKey, kv: SpanKV) -> Segment:
        """The segment for ``key``, holding ``kv`` [L, H_kv, S, D] (copied in on first use); one more holder."""
        with self._lock:
            segment = self._segments.get(key)
            if segment is None:
                segment = self._insert(key, kv)
            elif segment.holders == 0:
                del self._idle[key]
            segment.holders += 1
            return segment

    def release(self, segment: Segment) -> None:
        """One holder fewer; a segment no request holds stays cached until its chunks are needed."""
        with self._lock:
            assert segment.holders > 0, "released more often than acquired"
            segment.holders -= 1
            if segment.holders == 0:
                self._idle[segment.key] = None

    def view(self, segment: Segment, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``segment`` at ``layer``: views [H_kv, S, D] of the pool."""
        return self.span(segment.start, segment.start + segment.length, layer)

    def span(self, start: int, end: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of pool tokens ``start:end`` at ``layer``: views [H_kv, end - start, D]."""
        return self.keys[layer, :, start:end], self.values[layer, :, start:end]

    def held_bytes(self) -> int:
        """Bytes of the chunks that segments held by live requests occupy."""
        with self._lock:
            return sum(s.chunks for s in self._segments.values() if s.holders) * self.chunk_bytes

    def _insert(self, key: SegmentKey, kv: SpanKV) -> Segment:
        layers, kv_heads, _, head_dim = self.keys.shape
        length = kv.length
        if kv.keys.shape != (layers, kv_heads, length, head_dim) or kv.values.shape != kv.keys.shape:
            msg = (
                f"segment from {key.source!r}: KV of shape {tuple(kv.keys.shape)} does not fit a pool of "
                f"[{layers}, {kv_heads}, S, {head_dim}] (a different model?)"
            )
            raise ValueError(msg)
        if length != len(key.token_ids) or length != len(key.positions) or length == 0:
            raise ValueError(f"segment from {key.source!r}: {length} KV entries for {len(key.token_ids)} tokens")
        chunks = -(-length // CHUNK_TOKENS)
        first = self._allocate(chunks, key)
        segment = Segment(key, first, chunks, length)
        span = slice(segment.start, segment.start + length)
        self.keys[:, :, span] = kv.keys
        self.values[:, :, span] = kv.values
        tail = slice(segment.start + length, segment.start + chunks * CHUNK_TOKENS)  # finite padding: a run that
        self.keys[:, :, tail] = 0  # spans segments stored back to back masks it out, and a NaN would survive that
        self.values[:, :, tail] = 0
        self._segments[key] = segment
        return segment

    def _allocate(self, chunks: int, key: SegmentKey) -> int:
        """The first chunk of a free run of ``chunks``, dropping idle segments (least recently used first) as needed."""
        while True:
            for i, (first, count) in enumerate(self._free):
                if count >= chunks:
                    self._free[i : i + 1] = [(first + chunks, count - chunks)] if count > chunks else []
                    return first
            if self._idle:  # cached KV no request holds goes before the pool grows: its memory stays bounded
                oldest, _ = self._idle.popitem(last=False)
                dropped = self._segments.pop(oldest)
                self._free_chunks(dropped.first_chunk, dropped.chunks)
            elif self.chunks < self.max_chunks:
                self._grow(chunks)
            else:
                free = sum(count for _, count in self._free)
                held = sum(1 for s in self._segments.values() if s.holders)
                msg = (
                    f"no run of {chunks} free chunks for a segment from {key.source!r} ({free} of {self.chunks} "
                    f"chunks free, {held} segments held by live requests): a larger pool or fewer concurrent requests"
                )
                raise KVPoolFullError(msg)

    def _grow(self, chunks: int) -> None:
        """Twice the chunks (at least room for a run of ``chunks`` more, at most ``max_chunks``); segments keep
        their places, so only views taken before go stale."""
        before = self.chunks
        after = min(self.max_chunks, max(2 * before, before + chunks))
        for name in ("keys", "values"):
            old = getattr(self, name)
            layers, kv_heads, _, head_dim = old.shape
            with torch.inference_mode(False):  # a normal tensor, whether or not the caller is in inference mode
                new = old.new_empty(layers, kv_heads, after * CHUNK_TOKENS, head_dim)
            new[:, :, : before * CHUNK_TOKENS] = old
            setattr(self, name, new)
        self.chunks = after
        self._free_chunks(before, after - before)  # merged with a free run at the end

    def _free_chunks(self, first: int, count: int) -> None:
        i = bisect.bisect(self._free, (first, count))
        if i < len(self._free) and self._free[i][0] == first + count:  # merge with the run after
            count += self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == first:  # and the one before
            first, count = self._free[i - 1][0], self._free[i - 1][1] + count
            i -= 1
            self._free.pop(i)
        self._free.insert(i, (first, count))
