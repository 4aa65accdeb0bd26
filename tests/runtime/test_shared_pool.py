"""The shared KV pool keeps one copy per segment, reuses idle ones, evicts least recently used, never loses live KV."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pc_rag.errors import KVPoolFullError
from pc_rag.kv import SpanKV
from pc_rag.runtime.shared_pool import CHUNK_TOKENS, SegmentKey, SharedKVPool

LAYERS, HEADS, DIM = 2, 3, 8


def _span(length: int, seed: int) -> SpanKV:
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, LAYERS, HEADS, length, DIM, generator=g)
    return SpanKV(keys, values, torch.arange(length))


def _key(name: str, length: int, start: int = 0) -> SegmentKey:
    return SegmentKey(name, tuple(range(length)), tuple(range(start, start + length)))


def _pool(chunks: int) -> SharedKVPool:
    return SharedKVPool(LAYERS, HEADS, DIM, chunks=chunks)


def test_a_segment_is_stored_once_and_read_back_exactly():
    pool = _pool(8)
    kv = _span(100, 0)
    first = pool.acquire(_key("preamble", 100), kv)
    again = pool.acquire(_key("preamble", 100), _span(100, 1))  # same key: the stored copy, not the new tensors
    assert first is again and first.holders == 2 and first.chunks == 2
    for layer in range(LAYERS):
        keys, values = pool.view(first, layer)
        torch.testing.assert_close(keys, kv.keys[layer], rtol=0, atol=0)
        torch.testing.assert_close(values, kv.values[layer], rtol=0, atol=0)
    assert pool.held_bytes() == 2 * pool.chunk_bytes == 2 * 2 * LAYERS * HEADS * CHUNK_TOKENS * DIM * 4


def test_same_tokens_at_other_positions_or_from_another_source_are_other_segments():
    pool = _pool(8)
    base = pool.acquire(_key("m", 10), _span(10, 0))
    assert pool.acquire(_key("m", 10, start=5), _span(10, 1)) is not base
    assert pool.acquire(_key("other", 10), _span(10, 2)) is not base


def test_idle_segments_stay_cached_until_their_room_is_needed_least_recent_first():
    pool = _pool(3)
    a = pool.acquire(_key("a", 64), _span(64, 0))
    b = pool.acquire(_key("b", 64), _span(64, 1))
    pool.release(a)
    pool.release(b)
    assert pool.acquire(_key("a", 64), _span(64, 9)) is a  # idle, still cached: reused
    pool.release(a)  # now b is the least recently used idle segment
    pool.acquire(_key("c", 128), _span(128, 2))  # needs 2 chunks: 1 free, b's is dropped
    assert pool.acquire(_key("a", 64), _span(64, 9)) is a
    pool.release(a)
    again = pool.acquire(_key("b", 64), _span(64, 1))  # b was dropped: stored anew, in a's room
    assert again is not b and again.first_chunk == a.first_chunk


def test_a_full_pool_says_why_and_keeps_live_segments():
    pool = _pool(2)
    live = pool.acquire(_key("a", 100), _span(100, 0))
    with pytest.raises(KVPoolFullError, match="1 segments held by live requests"):
        pool.acquire(_key("b", 10), _span(10, 1))
    torch.testing.assert_close(pool.view(live, 0)[0], _span(100, 0).keys[0], rtol=0, atol=0)


def test_a_growable_pool_doubles_when_live_segments_fill_it_and_keeps_their_kv():
    pool = SharedKVPool(LAYERS, HEADS, DIM, chunks=2, max_chunks=5)
    a = pool.acquire(_key("a", 100), _span(100, 0))  # 2 chunks: full
    b = pool.acquire(_key("b", 64), _span(64, 1))  # grown to 4
    assert pool.chunks == 4 and b.first_chunk == 2
    c = pool.acquire(_key("c", 128), _span(128, 2))  # 1 free: grown to 5 (the cap), the free chunk and the new one
    assert pool.chunks == 5 and c.first_chunk == 3
    for segment, seed in ((a, 0), (b, 1), (c, 2)):
        torch.testing.assert_close(pool.view(segment, 1)[0], _span(segment.length, seed).keys[1], rtol=0, atol=0)
    with pytest.raises(KVPoolFullError, match="0 of 5 chunks free"):
        pool.acquire(_key("d", 1), _span(1, 3))


def test_idle_segments_are_dropped_before_the_pool_grows():
    pool = SharedKVPool(LAYERS, HEADS, DIM, chunks=1, max_chunks=4)
    pool.release(pool.acquire(_key("a", 64), _span(64, 0)))
    pool.acquire(_key("b", 64), _span(64, 1))
    assert pool.chunks == 1


def test_a_pool_cannot_be_capped_below_its_size():
    with pytest.raises(ValueError, match="cannot grow to at most 1"):
        SharedKVPool(LAYERS, HEADS, DIM, chunks=2, max_chunks=1)


def test_kv_of_another_model_is_refused():
    pool = _pool(2)
    wrong = SpanKV(torch.zeros(LAYERS, HEADS + 1, 4, DIM), torch.zeros(LAYERS, HEADS + 1, 4, DIM), torch.arange(4))
    with pytest.raises(ValueError, match="a different model"):
        pool.acquire(_key("a", 4), wrong)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 200), st.booleans()), min_size=1, max_size=40))
def test_live_segments_never_overlap_and_freed_chunks_coalesce(steps):
    pool = _pool(12)
    held: dict[str, object] = {}
    for name, length, release in steps:
        key = f"s{name}-{length}"
        if key in held:
            if release:
                pool.release(held.pop(key))
            continue
        try:
            held[key] = pool.acquire(_key(key, length), _span(length, name))
        except KVPoolFullError:
            continue
        live = sorted((s.first_chunk, s.first_chunk + s.chunks) for s in held.values())
        assert all(end <= start for (_, end), (start, _) in itertools.pairwise(live))
        for s in held.values():
            torch.testing.assert_close(pool.view(s, 1)[1], _span(s.length, int(s.key.source[1])).values[1])
    for s in held.values():
        pool.release(s)
    pool.acquire(_key("all", 12 * CHUNK_TOKENS), _span(12 * CHUNK_TOKENS, 0))  # idle ones dropped, runs merged
