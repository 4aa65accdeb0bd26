"""The adaptive loader over a throttled link: best level that fits, lighter as the link slows, text when cheaper."""

from __future__ import annotations

import time

import pytest
import torch
from test_store_kvstore_codec import codec, span  # noqa: F401 (the codec fixture)

from pc_rag.codec import CacheGenCodec
from pc_rag.store.kvstore import KVStore
from pc_rag.store.loader import RAW, TEXT, AdaptiveLoader, StoreSource, Throttled

CHUNKS = 6


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def source(tmp_path, codec: CacheGenCodec) -> StoreSource:  # noqa: F811
    store = KVStore(tmp_path, codec=codec, levels=(1, 3, 5))
    store.put_many({i: span(i) for i in range(CHUNKS)})
    return StoreSource(store)


def load(source, codec, bytes_per_s, *, target=0.5, recompute=1.0, initial=None):  # noqa: F811
    clock = FakeClock()
    loader = AdaptiveLoader(
        Throttled(source, bytes_per_s, clock=clock), codec, ttft_target_s=target, decode_s_per_token=0.0,
        recompute_s_per_token=recompute, initial_bytes_per_s=initial or bytes_per_s, clock=clock,
    )  # fmt: skip
    return loader.load([(i, 24) for i in range(CHUNKS)]), clock.t


def test_the_level_follows_the_link(source, codec) -> None:  # noqa: F811
    sizes = {n: source.size(0, n) for n in (1, 3, 5)}
    assert sizes[1] < sizes[3] < sizes[5]
    per_chunk = 0.5 / CHUNKS  # the target's share of each chunk
    levels = {}
    for name, bandwidth in {"fast": 10 * sizes[5] / per_chunk, "mid": 1.01 * sizes[3] / per_chunk,
                            "slow": 1.01 * sizes[1] / per_chunk}.items():  # fmt: skip
        loaded, elapsed = load(source, codec, bandwidth)
        levels[name] = {x.level for x in loaded}
        assert elapsed <= 0.5 + 1e-9, (name, elapsed)
    assert levels == {"fast": {5}, "mid": {3}, "slow": {1}}


def test_text_when_recomputing_beats_the_lightest_level(source, codec) -> None:  # noqa: F811
    crawl = source.size(0, 1) / 10.0  # ten seconds per chunk at the lightest level
    loaded, elapsed = load(source, codec, crawl, recompute=1e-3)
    assert {x.level for x in loaded} == {TEXT} and all(x.span is None for x in loaded) and elapsed == 0
    loaded, _ = load(source, codec, crawl, recompute=10.0)  # recomputing is dearer still: the lightest level
    assert {x.level for x in loaded} == {1}


def test_a_wrong_first_estimate_is_corrected_by_the_next_fetch(source, codec) -> None:  # noqa: F811
    slow = 1.01 * source.size(0, 1) / (0.5 / CHUNKS)
    loaded, _ = load(source, codec, slow, initial=1e12)
    assert loaded[0].level == 5 and {x.level for x in loaded[1:]} <= {1}


def test_loaded_spans_are_the_stores_decoding(source, codec) -> None:  # noqa: F811
    loaded, _ = load(source, codec, 1e12)
    for x in loaded:
        assert torch.equal(x.span.keys, source.store.get(x.chunk_id, level=x.level).keys)


def test_the_throttle_holds_a_real_read_to_its_bandwidth(source) -> None:
    size = source.size(0, 5)
    link = Throttled(source, bytes_per_s=size / 0.05)
    began = time.perf_counter()
    link.read(0, 5)
    assert time.perf_counter() - began >= 0.05
    with pytest.raises(ValueError, match="positive"):
        Throttled(source, 0)


class WithRaw:
    """A store source that also keeps each chunk raw, ten times the size of its best level."""

    def __init__(self, source: StoreSource) -> None:
        self.source = source

    def levels(self, chunk_id: int) -> tuple[int, ...]:
        return (RAW, *self.source.levels(chunk_id))

    def size(self, chunk_id: int, level: int) -> int:
        return 10 * self.source.size(chunk_id, 5) if level == RAW else self.source.size(chunk_id, level)

    def read(self, chunk_id: int, level: int) -> bytes:
        return bytes(self.size(chunk_id, level)) if level == RAW else self.source.read(chunk_id, level)


def test_raw_kv_is_the_best_level_when_the_link_carries_it(source, codec) -> None:  # noqa: F811
    raw = WithRaw(source)
    decoded = []

    def decode(chunk_id: int, level: int, data: bytes):
        decoded.append(level)
        return None if level == RAW else codec.decode(data)

    for bandwidth, expected in [(1e12, {RAW}), (1.01 * source.size(0, 5) / (0.5 / CHUNKS), {5})]:
        clock = FakeClock()
        loader = AdaptiveLoader(
            Throttled(raw, bandwidth, clock=clock), codec, ttft_target_s=0.5, decode_s_per_token=0.0,
            recompute_s_per_token=1.0, initial_bytes_per_s=bandwidth, clock=clock, decode=decode,
        )  # fmt: skip
        assert {x.level for x in loader.load([(i, 24) for i in range(CHUNKS)])} == expected
    assert sorted(set(decoded)) == [RAW, 5]
    with pytest.raises(ValueError, match="no decoder for raw KV"):
        AdaptiveLoader(Throttled(raw, 1e12), codec, ttft_target_s=0.5, decode_s_per_token=0.0,
                       recompute_s_per_token=1.0, initial_bytes_per_s=1e12).load([(0, 24)])  # fmt: skip


def test_decoding_overlaps_the_next_fetch(source, codec) -> None:  # noqa: F811
    fetch = 0.05  # seconds per chunk on the link, and as long again to decode it

    def slow_decode(chunk_id: int, level: int, data: bytes):
        time.sleep(fetch)
        return codec.decode(data)

    link = Throttled(source, source.size(0, 5) / fetch)
    loader = AdaptiveLoader(link, codec, ttft_target_s=100.0, decode_s_per_token=0.0, recompute_s_per_token=1.0,
                            initial_bytes_per_s=link.bytes_per_s, decode=slow_decode)  # fmt: skip
    began = time.perf_counter()
    loaded = loader.load([(i, 24) for i in range(CHUNKS)])
    elapsed = time.perf_counter() - began
    assert [x.level for x in loaded] == [5] * CHUNKS and all(x.span is not None for x in loaded)
    assert elapsed < 0.8 * 2 * fetch * CHUNKS, elapsed  # fetched and decoded one after the other: 2 * 0.3 s
    assert loader.decode_cost == pytest.approx(fetch / 24, rel=0.5)  # measured, no longer the initial 0
