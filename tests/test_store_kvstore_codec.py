"""Compressed chunk KV in the store: levels per chunk, raw and compressed shards side by side, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from pc_rag.codec import CacheGenCodec, fit_tables
from pc_rag.errors import CodecError, StoreCorruptedError, StoreError
from pc_rag.kv import SpanKV
from pc_rag.store.kvstore import KVStore
from pc_rag.store.manifest import MANIFEST_NAME, Manifest

LAYERS, HEADS, DIM = 3, 2, 8


def span(seed: int, length: int = 24) -> SpanKV:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, HEADS, length, DIM)
    return SpanKV(torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.arange(40, 40 + length))


@pytest.fixture(scope="module")
def codec() -> CacheGenCodec:
    return CacheGenCodec(fit_tables([(s.keys, s.values) for s in map(span, range(100, 106))], "test-model"))


def error(a: SpanKV, b: SpanKV) -> float:
    return float((a.keys - b.keys).square().mean() + (a.values - b.values).square().mean())


def test_chunks_come_back_at_the_level_asked_and_cost_less_than_raw(tmp_path, codec: CacheGenCodec) -> None:
    spans = {i: span(i) for i in range(4)}
    store = KVStore(tmp_path / "c", codec=codec, levels=(2, 4))
    store.put_many(spans)
    raw = KVStore(tmp_path / "r", dtype=torch.bfloat16)
    raw.put_many(spans)
    assert store.nbytes < raw.nbytes
    reopened = KVStore(tmp_path / "c", codec=codec)
    best, coarse = reopened.get(1), reopened.get(1, level=2)
    assert torch.equal(best.positions, spans[1].positions)
    assert 0 < error(best, spans[1]) < error(coarse, spans[1])
    assert torch.equal(best.keys, codec.decode(codec.encode(spans[1], 4)).keys)
    assert reopened.get(1) is best  # decoded once, then served from the LRU, per level
    assert KVStore(tmp_path / "c", codec=codec, level=2).get(1).keys.equal(coarse.keys)
    with pytest.raises(StoreError, match=r"levels \[2, 4\], not at level 3"):
        reopened.get(1, level=3)


def test_a_raw_store_keeps_loading_after_it_starts_writing_compressed_shards(tmp_path, codec) -> None:
    KVStore(tmp_path).put_many({0: span(0), 1: span(1)})
    mixed = KVStore(tmp_path, codec=codec, levels=(3,))
    mixed.put_many({2: span(2), 1: span(11)})  # chunk 1 replaced by a compressed version
    again = KVStore(tmp_path, codec=codec)
    assert torch.equal(again.get(0).keys, span(0).keys)  # raw, exact
    assert 0 < error(again.get(1), span(11)) < error(again.get(1), span(1))
    assert again.manifest.shards[again._where[2]].levels == (3,)


def test_compaction_keeps_compressed_chunks_byte_for_byte(tmp_path, codec: CacheGenCodec) -> None:
    store = KVStore(tmp_path, codec=codec, levels=(1, 4))
    store.put_many({i: span(i) for i in range(3)})
    before = {i: store.get(i, level=1).keys.clone() for i in (0, 2)}
    store.delete([1])
    assert store.compact() > 0
    again = KVStore(tmp_path, codec=codec)
    assert 1 not in again and all(torch.equal(again.get(i, level=1).keys, before[i]) for i in (0, 2))


def test_shards_compressed_with_other_tables_are_refused(tmp_path, codec: CacheGenCodec) -> None:
    KVStore(tmp_path, codec=codec, levels=(2,)).put(0, span(0))
    other = CacheGenCodec(fit_tables([(span(7).keys, span(7).values)], "test-model"))
    with pytest.raises(StoreCorruptedError, match="compressed as cachegen:"):
        KVStore(tmp_path, codec=other).get(0)
    with pytest.raises(StoreCorruptedError, match="no codec tables"):
        KVStore(tmp_path).get(0)


def test_levels_need_a_codec_that_has_them(tmp_path, codec: CacheGenCodec) -> None:
    with pytest.raises(ValueError, match="need a codec"):
        KVStore(tmp_path, levels=(2,))
    with pytest.raises(CodecError, match="no level 9"):
        KVStore(tmp_path, codec=codec, levels=(9,))


def test_manifests_record_the_codec_and_older_ones_still_read(tmp_path, codec: CacheGenCodec) -> None:
    store = KVStore(tmp_path, codec=codec, levels=(2,))
    store.put(0, span(0))
    data = json.loads((tmp_path / MANIFEST_NAME).read_text())
    (record,) = data["shards"].values()
    assert record["codec"] == f"cachegen:{codec.tables.digest}" and record["levels"] == [2]
    for shard in data["shards"].values():
        del shard["codec"], shard["levels"]
    data["format_version"] = 2
    del data["codec_tables"]
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(data))
    old = Manifest.load(tmp_path / MANIFEST_NAME)
    assert all(s.codec == "" and s.levels == () for s in old.shards.values()) and old.codec_tables is None
