"""The adaptive loader over a throttled link: best level that fits, lighter as the link slows, text when cheaper."""

from __future__ import annotations

import time

import pytest
import torch
from test_store_kvstore_codec import codec, span  # noqa: F401 (the codec fixture)

from pc_rag.codec import CacheGenCodec
from pc_rag.store.kvstore import KVStore
from pc_rag.store.loader import TEXT, AdaptiveLoader, StoreSource, Throttled

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
