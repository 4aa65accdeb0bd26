"""Chunk KV persistence and the store manifest: round trips, deletion, corruption, crash safety, LRU budget."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace

import pytest
import torch

from pc_rag.errors import StoreCorruptedError, StoreError, StoreMismatchError
from pc_rag.kv import SpanKV
from pc_rag.store.kvstore import KVStore
from pc_rag.store.manifest import (
    MANIFEST_NAME,
    ChunkRecord,
    DocRecord,
    Manifest,
    ShardRecord,
    StoreIdentity,
)

LAYERS, HEADS, HEAD_DIM = 3, 2, 16


def span(seed: int, length: int = 7) -> SpanKV:
    """A random span: keys/values [L, H_kv, S, D], positions [S] starting at 10."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, HEADS, length, HEAD_DIM)
    return SpanKV(torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.arange(10, 10 + length))


def span_bytes(length: int = 7) -> int:
    return 2 * LAYERS * HEADS * length * HEAD_DIM * 4 + length * 8


def assert_same(a: SpanKV, b: SpanKV, atol: float = 0.0) -> None:
    torch.testing.assert_close(a.keys.float(), b.keys.float(), atol=atol, rtol=atol)
    torch.testing.assert_close(a.values.float(), b.values.float(), atol=atol, rtol=atol)
    assert torch.equal(a.positions, b.positions)


def shard_files(directory) -> list[str]:
    return sorted(p.name for p in (directory / "kv").iterdir())


@pytest.mark.parametrize(
    ("dtype", "atol"), [(torch.float32, 0.0), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)], ids=str
)
def test_round_trip_through_a_fresh_store(tmp_path, dtype: torch.dtype, atol: float) -> None:
    spans = {i: span(i, length=5 + i) for i in range(6)}
    store = KVStore(tmp_path, dtype=dtype, compute_dtype=torch.float32)
    store.put_many({i: spans[i] for i in range(3)})
    store.put_many({i: spans[i] for i in range(3, 6)})
    reopened = KVStore(tmp_path, compute_dtype=torch.float32)
    assert len(reopened) == 6 and 5 in reopened and 6 not in reopened
    for original, loaded in zip(spans.values(), reopened.get_many(range(6)), strict=True):
        assert loaded.keys.dtype == torch.float32
        assert_same(original, loaded, atol)
    with pytest.raises(KeyError, match="chunk 6"):
        reopened.get(6)


def test_putting_an_id_again_replaces_it(tmp_path) -> None:
    store = KVStore(tmp_path)
    store.put_many({1: span(1), 2: span(2)})
    store.get(1)  # cached, must not be served stale
    store.put(1, span(99))
    assert_same(store.get(1), span(99))
    assert_same(KVStore(tmp_path).get(1), span(99))
    assert len(store) == 2


def test_delete_then_compact_frees_space_and_keeps_the_rest(tmp_path) -> None:
    store = KVStore(tmp_path, dtype=torch.bfloat16)
    store.put_many({i: span(i) for i in range(4)})
    store.put_many({i: span(i) for i in range(4, 6)})
    size = store.nbytes
    assert store.delete([0, 1, 4, 5, 42]) == 4
    assert 0 not in store and len(store) == 2 and store.nbytes == size
    with pytest.raises(KeyError):
        store.get(4)
    assert KVStore(tmp_path).ids() == [2, 3]
    freed = store.compact()
    assert freed > 0 and store.nbytes == size - freed
    assert len(shard_files(tmp_path)) == 1  # the all-dead shard is gone, the other rewritten
    for store_view in (store, KVStore(tmp_path)):
        assert store_view.ids() == [2, 3]
        assert_same(store_view.get(3), span(3), atol=2e-2)
    store.verify()


def test_a_flipped_byte_is_detected_and_the_shard_named(tmp_path) -> None:
    KVStore(tmp_path).put_many({1: span(1), 2: span(2)})
    (name,) = shard_files(tmp_path)
    path = tmp_path / "kv" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    store = KVStore(tmp_path)
    with pytest.raises(StoreCorruptedError, match=f"shard kv/{name} .*does not match its checksum"):
        store.get(1)  # the chunk the flipped byte is in (the other one is intact: see test_store_repair.py)
    with pytest.raises(StoreCorruptedError, match=name):
        store.verify()


def test_open_shards_verifies_every_shard_once_before_any_read(tmp_path, monkeypatch) -> None:
    from pc_rag.store import kvstore

    KVStore(tmp_path).put_many({1: span(1)})
    KVStore(tmp_path).put_many({2: span(2)})
    gone, kept = shard_files(tmp_path)
    (tmp_path / "kv" / gone).unlink()
    hashed: list[str] = []
    real_sha256 = kvstore.sha256_file
    monkeypatch.setattr(kvstore, "sha256_file", lambda path: hashed.append(path.name) or real_sha256(path))
    store = KVStore(tmp_path)
    (problem,) = store.open_shards()  # the missing shard, named; the other one opened
    assert gone in problem and "missing" in problem
    assert hashed == [kept]
    assert_same(store.get(2), span(2))
    assert hashed == [kept]  # the read paid no checksum: it was verified when opened


def test_a_missing_shard_is_named(tmp_path) -> None:
    store = KVStore(tmp_path)
    store.put_many({1: span(1)})
    store.put_many({2: span(2)})
    first = shard_files(tmp_path)[0]
    (tmp_path / "kv" / first).unlink()
    fresh = KVStore(tmp_path)
    assert_same(fresh.get(2), span(2))
    with pytest.raises(StoreCorruptedError, match=f"shard kv/{first} is missing"):
        fresh.get(1)
    with pytest.raises(StoreCorruptedError, match=f"kv/{first} is missing"):
        fresh.verify()


@pytest.mark.parametrize("failing_call", [1, 2], ids=["shard-rename", "manifest-rename"])
def test_a_crash_mid_write_leaves_the_previous_store(tmp_path, monkeypatch, failing_call: int) -> None:
    store = KVStore(tmp_path)
    store.put_many({1: span(1), 2: span(2)})
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    real_replace, calls = os.replace, []

    def crashing_replace(src, dst) -> None:
        calls.append(dst)
        if len(calls) == failing_call:
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crashing_replace)
    with pytest.raises(OSError, match="simulated crash"):
        store.put_many({3: span(3), 1: span(99)})
    monkeypatch.undo()
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # no temp or orphan files
    for view in (store, KVStore(tmp_path)):
        assert view.ids() == [1, 2]
        assert_same(view.get(1), span(1))
    store.put_many({3: span(3)})  # and the store still works
    assert KVStore(tmp_path).ids() == [1, 2, 3]


def test_lru_stays_within_its_byte_budget(tmp_path) -> None:
    store = KVStore(tmp_path, lru_bytes=int(2.5 * span_bytes()))
    store.put_many({i: span(i) for i in range(5)} | {9: span(9, length=30)})
    first = store.get(0)
    assert store.get(0) is first  # served from the LRU
    for i in range(5):
        store.get(i)
        assert store.lru_nbytes <= store.lru_bytes
    assert store.lru_nbytes == 2 * span_bytes()
    assert store.get(0) is not first  # evicted, decoded again
    store.get(9)  # larger than the whole budget: returned, never cached
    assert store.lru_nbytes <= store.lru_bytes
    store.close()
    assert store.lru_nbytes == 0


def test_bad_spans_and_dtypes_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="storage dtype"):
        KVStore(tmp_path, dtype=torch.int8)
    store = KVStore(tmp_path)
    bad = SpanKV(torch.zeros(2, 2, 3, 4), torch.zeros(2, 2, 4, 4), torch.arange(3))
    with pytest.raises(ValueError, match=r"\[L, H_kv, S, D\]"):
        store.put(1, bad)
    with pytest.raises(ValueError, match="non-negative"):
        store.put(-1, span(1))
    assert not (tmp_path / MANIFEST_NAME).exists()


IDENTITY = StoreIdentity(
    model_name="smollm2-135m-instruct",
    model_fingerprint="0123456789abcdef",
    model_dtype="torch.float32",
    tokenizer_hash="fedcba9876543210",
    chunk_tokens=256,
    overlap_tokens=32,
    preamble_hash="aaaa",
    encoding_mode="isolated",
    start_position=64,
    embedder_name="sentence-transformers:all-MiniLM-L6-v2",
    embedder_dim=384,
    index_kind="flat",
)


def test_manifest_round_trip(tmp_path) -> None:
    manifest = Manifest(
        identity=IDENTITY,
        chunks={
            0: ChunkRecord("doc-a", "Paris is in France. ünïcode", 7, 0, 27, {"url": "x", "tags": ["a", 1]}),
            5: ChunkRecord("doc-a", "Second chunk.", 3, 20, 33),
        },
        docs={"doc-a": DocRecord((0, 5), "abc123", {"title": "A"})},
        shards={"kv/00000001-aaaaaaaa.safetensors": ShardRecord("f" * 64, 1234, (0, 5), dead=(5,))},
    )
    manifest.save(tmp_path / MANIFEST_NAME)
    assert Manifest.load(tmp_path / MANIFEST_NAME) == manifest
    assert manifest.next_chunk_id() == 6
    manifest.chunks[9] = ChunkRecord("doc-b", "x", 1, metadata={"bad": object()})
    with pytest.raises(StoreError, match="JSON-serializable"):
        manifest.save(tmp_path / MANIFEST_NAME)
    assert Manifest.load(tmp_path / MANIFEST_NAME).chunks.keys() == {0, 5}  # the failed save changed nothing


def test_mismatch_names_every_differing_field() -> None:
    manifest = Manifest(identity=IDENTITY)
    manifest.check_compatible(IDENTITY)
    manifest.check_compatible({"model_fingerprint": "0123456789abcdef"})
    other = replace(IDENTITY, model_fingerprint="9999", index_kind="hnsw", chunk_tokens=128)
    with pytest.raises(StoreMismatchError) as info:
        manifest.check_compatible(other)
    assert set(info.value.fields) == {"model_fingerprint", "index_kind", "chunk_tokens"}
    assert "model_fingerprint: store was built with '0123456789abcdef', you loaded '9999'" in str(info.value)
    assert "index_kind: store was built with 'flat', you loaded 'hnsw'" in str(info.value)
    with pytest.raises(ValueError, match="unknown store identity fields"):
        manifest.check_compatible({"modle_name": "x"})
    with pytest.raises(StoreMismatchError, match="no identity"):
        Manifest().check_compatible(IDENTITY)


@pytest.mark.parametrize(
    ("content", "error", "match"),
    [
        (json.dumps({"format_version": 99, "chunks": {}, "docs": {}, "shards": {}}), StoreError, "format version 99"),
        (json.dumps({"chunks": {}}), StoreError, "format version None"),
        ("{not json", StoreCorruptedError, "not valid JSON"),
        (
            json.dumps({"format_version": 1, "chunks": {"0": {"text": "x"}}, "docs": {}, "shards": {}}),
            StoreCorruptedError,
            "malformed",
        ),
        (json.dumps({"format_version": 1, "identity": asdict(IDENTITY) | {"x": 1}}), StoreCorruptedError, "malformed"),
    ],
    ids=["newer-version", "no-version", "not-json", "bad-chunk", "bad-identity"],
)
def test_bad_manifests_are_refused(tmp_path, content: str, error: type, match: str) -> None:
    path = tmp_path / MANIFEST_NAME
    path.write_text(content)
    with pytest.raises(error, match=match):
        Manifest.load(path)
    with pytest.raises(error, match=match):
        KVStore(tmp_path)


def test_missing_manifest_is_a_store_error(tmp_path) -> None:
    with pytest.raises(StoreError, match="no store manifest"):
        Manifest.load(tmp_path / MANIFEST_NAME)


def test_a_store_of_another_model_names_the_flag_that_loads_it() -> None:
    manifest = Manifest(identity=replace(IDENTITY, model_name="gemma3-270m"))
    other = replace(IDENTITY, model_name="smollm2-135m-instruct", model_fingerprint="9999", tokenizer_hash="t2",
                    index_kind="hnsw")  # fmt: skip
    with pytest.raises(StoreMismatchError) as info:
        manifest.check_compatible(other)
    assert str(info.value) == (
        "the store was built with the model 'gemma3-270m', not 'smollm2-135m-instruct': give `--model gemma3-270m` "
        "(in Python: load_model('gemma3-270m')); it also differs in index_kind"
    )
    assert set(info.value.fields) == {"model_name", "model_fingerprint", "tokenizer_hash", "index_kind"}
