"""Automatic prefix caching: the KV of token prefixes a request computed, reused by the next request that starts
with them (a conversation's history), bounded by a byte budget with LRU eviction.

Entries are keyed by their token ids, KV at positions ``0..n-1`` (the prefix is the start of the prompt, so its KV
depends on its ids alone). A lookup returns the longest cached prefix of the ids asked for; ``encode`` computes
only the rest, after it, and keeps the whole. An entry that is a prefix of a new one is dropped (the new one
serves both), so a conversation holds one entry that grows by a turn per request. This is SGLang's radix cache
and vLLM's block hashes without the tree: the entries are few (one per live conversation), compared token by
token. This module knows nothing about chat templates, chunks or HTTP.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from pc_rag.encode import encode_spans
from pc_rag.kv import SpanKV

DEFAULT_BUDGET_BYTES = 512 * 2**20


@dataclass(frozen=True)
class CachedPrefix:
    """The KV of a prompt's leading tokens (positions from 0) and how many of them were read from the cache."""

    kv: SpanKV
    cached: int

    @property
    def computed(self) -> int:
        return self.kv.length - self.cached


class PrefixCache:
    """KV of token prefixes, least recently used evicted past ``budget_bytes``; thread-safe."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[tuple[int, ...], SpanKV] = OrderedDict()
        self._lock = threading.Lock()
        self.queries = 0  # tokens looked up
        self.hits = 0  # tokens found

    def held_bytes(self) -> int:
        with self._lock:
            return sum(kv.nbytes for kv in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, ids: Sequence[int]) -> SpanKV | None:
        """The KV of the longest cached prefix of ``ids`` (a view; None when nothing matches)."""
        key = tuple(ids)
        with self._lock:
            best, best_key = 0, None
            for cached in self._entries:
                n = _common(cached, key)
                if n > best:
                    best, best_key = n, cached
            self.queries += len(key)
            self.hits += best
            if best_key is None:
                return None
            self._entries.move_to_end(best_key)
            kv = self._entries[best_key]
        return SpanKV(kv.keys[:, :, :best], kv.values[:, :, :best], kv.positions[:best])

    def insert(self, ids: Sequence[int], kv: SpanKV) -> None:
        """Keep ``kv`` (of ``ids`` at positions from 0); entries that are prefixes of ``ids`` are dropped."""
        assert kv.length == len(ids), "the KV of a prefix covers its ids"
        key = tuple(ids)
        if kv.nbytes > self.budget_bytes:
            return
        with self._lock:
            for cached in [c for c in self._entries if len(c) <= len(key) and key[: len(c)] == c]:
                del self._entries[cached]
            self._entries[key] = kv
            held = sum(e.nbytes for e in self._entries.values())
            while held > self.budget_bytes:
                _, evicted = self._entries.popitem(last=False)
                held -= evicted.nbytes

    @torch.inference_mode()
    def encode(self, model: PreTrainedModel, ids: Sequence[int]) -> CachedPrefix:
        """The KV of ``ids`` at positions from 0: the cached prefix, the rest computed after it; kept for reuse."""
        prefix = self.match(ids)
        cached = prefix.length if prefix is not None else 0
        if cached == len(ids):
            assert prefix is not None
            return CachedPrefix(prefix, cached)
        (rest,) = encode_spans(model, [(ids[cached:], range(cached, len(ids)))], context=prefix)
        if prefix is None:
            kv = rest
        else:  # k: [L, H_kv, S, D]
            device = rest.keys.device
            keys = torch.cat((prefix.keys.to(device), rest.keys), dim=2)
            values = torch.cat((prefix.values.to(device), rest.values), dim=2)
            kv = SpanKV(keys, values, torch.cat((prefix.positions, rest.positions)))
        self.insert(ids, kv)
        return CachedPrefix(kv, cached)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
