"""The prefix cache returns the longest cached prefix, computes only the rest (the same KV as computing it all),
keeps one entry per growing conversation, and evicts the least recently used past its budget."""

from __future__ import annotations

import torch
from conftest import tiny_model

from pc_rag.encode import encode_spans
from pc_rag.kv import SpanKV
from pc_rag.runtime.prefix_cache import PrefixCache


def _kv(n: int, start: int = 0) -> SpanKV:
    keys = torch.arange(start, start + n, dtype=torch.float32).reshape(1, 1, n, 1)
    return SpanKV(keys, keys.clone(), torch.arange(n))


def test_the_longest_cached_prefix_is_returned_and_counted() -> None:
    cache = PrefixCache()
    cache.insert([1, 2, 3, 4], _kv(4))
    cache.insert([1, 9], _kv(2, start=100))
    hit = cache.match([1, 2, 3, 7, 7])
    assert hit is not None and hit.length == 3 and hit.keys.flatten().tolist() == [0, 1, 2]
    assert cache.match([5, 1]) is None
    assert (cache.queries, cache.hits) == (7, 3)


def test_a_longer_turn_replaces_its_prefix_and_the_budget_evicts_the_least_recent() -> None:
    cache = PrefixCache(budget_bytes=_kv(6).nbytes)
    cache.insert([1, 2], _kv(2))
    cache.insert([1, 2, 3], _kv(3))  # the conversation grew: one entry
    assert len(cache) == 1
    cache.insert([7, 8], _kv(2))
    cache.match([1, 2, 3])  # the conversation is used again: [7, 8] is now the least recent
    cache.insert([5, 6], _kv(2))
    assert cache.match([7, 8]) is None and cache.match([1, 2, 3]) is not None
    assert cache.held_bytes() <= cache.budget_bytes


def test_encoding_after_a_cached_prefix_equals_encoding_it_all(tokenizer) -> None:
    lm = tiny_model("llama", tokenizer)
    ids = list(range(5, 45))
    cache = PrefixCache()
    first = cache.encode(lm.model, ids[:25])
    second = cache.encode(lm.model, ids)
    assert (first.cached, first.computed) == (0, 25) and (second.cached, second.computed) == (25, 15)
    (whole,) = encode_spans(lm.model, [(ids, range(len(ids)))])
    torch.testing.assert_close(second.kv.keys, whole.keys, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(second.kv.values, whole.values, atol=1e-5, rtol=1e-4)
    assert second.kv.positions.tolist() == list(range(len(ids)))
    assert cache.encode(lm.model, ids).cached == len(ids)
