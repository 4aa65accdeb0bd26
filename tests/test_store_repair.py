"""Damaged KV loses only the chunks the damage touches: reads of intact chunks go on, a damaged one names
``pc-rag store repair``, and repair encodes it again from its text (or drops its document and says how to
restore it). Stores whose manifest has only shard checksums still load, verify and repair per shard."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from store_worker import document, engine
from test_document_store import embedder

from pc_rag.errors import StoreCorruptedError
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.manifest import MANIFEST_NAME

DOCS = 8


@pytest.fixture(scope="module")
def eng():
    return engine()


def build(directory: Path, eng) -> DocumentStore:
    store = DocumentStore.create(directory, eng, embedder=embedder(), chunk_tokens=24, overlap_tokens=4)
    docs = [(document(i), {"source": f"notes/doc{i}.txt"}) for i in range(DOCS)]
    store.add_documents(docs, [f"doc{i}" for i in range(DOCS)], progress=False)
    store.close()
    assert len(store.manifest.shards) == 1  # every chunk in one shard, as a small store has them
    return store


def flip_bytes(directory: Path, tensor: str, count: int = 4) -> None:
    """Flip ``count`` bytes in the middle of ``tensor``'s data in the store's only shard."""
    (path,) = (directory / "kv").glob("*.safetensors")
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    start, end = json.loads(data[8 : 8 + header_len])[tensor]["data_offsets"]
    middle = 8 + header_len + (start + end) // 2
    for i in range(count):
        data[middle + i] ^= 0xFF
    path.write_bytes(bytes(data))


def load(directory: Path, eng) -> DocumentStore:
    return DocumentStore.load(directory, eng, embedder=embedder())


def test_a_damaged_chunk_is_named_and_the_others_still_answer(tmp_path, eng) -> None:
    victim = build(tmp_path / "s", eng).manifest.docs["doc3"].chunk_ids[0]
    flip_bytes(tmp_path / "s", f"{victim}.k")
    store = load(tmp_path / "s", eng)
    intact = [c for c in store.manifest.chunks if c != victim]
    assert len(store.chunks([store.handle(c) for c in intact])) == len(intact)
    hint = re.escape(f"`pc-rag store repair --store {tmp_path / 's'}`")
    with pytest.raises(StoreCorruptedError, match=f"chunk {victim} .*{hint}"):
        store.chunks([store.handle(victim)])
    total = len(store.manifest.chunks)
    with pytest.raises(StoreCorruptedError, match=f"1 of its {total} chunks damaged: \\[{victim}\\]"):
        store.verify()


def test_repair_encodes_the_damaged_chunk_again_and_keeps_every_document(tmp_path, eng) -> None:
    victim = build(tmp_path / "s", eng).manifest.docs["doc3"].chunk_ids[0]
    before = load(tmp_path / "s", eng).kv.get(victim).keys.clone()  # a copy: spans may map the file
    flip_bytes(tmp_path / "s", f"{victim}.k")
    store = load(tmp_path / "s", eng)
    report = store.repair()
    assert report.reencoded_chunks == 1 and report.dropped_documents == ()
    assert report.restore_hint(store.directory) is None
    again = load(tmp_path / "s", eng)
    assert sorted(again.manifest.docs) == [f"doc{i}" for i in range(DOCS)]
    torch.testing.assert_close(again.kv.get(victim).keys, before)
    assert "sound" in again.verify()


def test_repair_without_the_model_drops_only_the_damaged_document_and_says_how_to_restore_it(tmp_path, eng) -> None:
    victim = build(tmp_path / "s", eng).manifest.docs["doc3"].chunk_ids[0]
    flip_bytes(tmp_path / "s", f"{victim}.k", count=4)
    store = load(tmp_path / "s", eng)
    report = store.repair(reencode=False)
    assert report.dropped_documents == ("doc3",) and report.reencoded_chunks == 0
    hint = report.restore_hint(store.directory)
    assert hint is not None and f"pc-rag index notes/doc3.txt --store {store.directory}" in hint
    again = load(tmp_path / "s", eng)
    assert sorted(again.manifest.docs) == sorted(f"doc{i}" for i in range(DOCS) if i != 3)  # 7 of 8 kept
    assert "sound" in again.verify()


def test_a_store_with_shard_checksums_only_verifies_and_repairs_per_shard(tmp_path, eng) -> None:
    victim = build(tmp_path / "s", eng).manifest.docs["doc3"].chunk_ids[0]
    path = tmp_path / "s" / MANIFEST_NAME
    data = json.loads(path.read_text())
    data["format_version"] = 4
    for shard in data["shards"].values():
        del shard["chunk_sha256"]
    path.write_text(json.dumps(data))
    assert "sound" in load(tmp_path / "s", eng).verify()  # an old store loads and verifies
    flip_bytes(tmp_path / "s", f"{victim}.k")
    store = load(tmp_path / "s", eng)
    total = len(store.manifest.chunks)
    with pytest.raises(StoreCorruptedError, match="pc-rag store repair"):
        store.chunks([store.handle(c) for c in store.manifest.chunks if c != victim])  # the whole shard is lost
    with pytest.raises(StoreCorruptedError, match=f"{total} of its {total} chunks damaged"):
        store.verify()
    report = store.repair()  # with the model: every chunk of the shard encoded again
    assert report.reencoded_chunks == total and report.dropped_documents == ()
    again = load(tmp_path / "s", eng)
    assert len(again.manifest.docs) == DOCS and "sound" in again.verify()
    assert all(len(s.chunk_sha256) == len(s.chunk_ids) for s in again.manifest.shards.values())  # now per chunk


def flip_header_byte(directory: Path, offset: int = 40) -> None:
    """Flip one byte of the store's only shard inside its safetensors header (JSON after the 8-byte length)."""
    (path,) = (directory / "kv").glob("*.safetensors")
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    assert 8 <= offset < 8 + header_len
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("offset", [40, 9, 60])
def test_repair_rewrites_a_shard_whose_header_is_damaged(tmp_path, eng, offset) -> None:
    build(tmp_path / "s", eng)
    flip_header_byte(tmp_path / "s", offset)
    store = load(tmp_path / "s", eng)
    with pytest.raises(StoreCorruptedError) as damaged:
        store.verify()
    assert str(damaged.value).count("pc-rag store repair") == 1, damaged.value  # the hint once
    report = store.repair()
    assert report.dropped_documents == ()
    again = load(tmp_path / "s", eng)
    assert "sound" in again.verify() and len(again.manifest.docs) == DOCS


def test_repair_without_the_model_on_header_damage_verifies_or_names_what_it_dropped(tmp_path, eng) -> None:
    build(tmp_path / "s", eng)
    flip_header_byte(tmp_path / "s", 40)
    report = load(tmp_path / "s", eng).repair(reencode=False)
    again = load(tmp_path / "s", eng)
    assert "sound" in again.verify()
    assert len(again.manifest.docs) == DOCS - len(report.dropped_documents)


def test_repair_that_leaves_damage_says_what_and_fails(tmp_path, eng, monkeypatch) -> None:
    build(tmp_path / "s", eng)
    flip_header_byte(tmp_path / "s", 40)
    store = load(tmp_path / "s", eng)
    monkeypatch.setattr(type(store.kv), "compact", lambda self, rewrite=(): 0)  # a repair that rewrites nothing
    with pytest.raises(StoreCorruptedError, match=r"repair could not fix everything .*shard kv/\S+ does not match its "
                                                  r"checksum") as left:  # fmt: skip
        store.repair()
    assert "pc-rag store repair" not in str(left.value)  # not sent back to the command that just failed
