"""The directory module store: round trips, refused keys, damage; and a document store keeping its KV in one."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_document_store import DOCS, embedder

from pc_rag.errors import ModuleCorruptedError, ModuleStoreError, StoreError
from pc_rag.modules.interface import ModuleStore
from pc_rag.modules.local_store import LocalModuleStore
from pc_rag.modules.open_store import open_module_store
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.store.document_store import DocumentStore

KEY = "pc-rag/v1/model/encoding/0123abcd"


def test_modules_round_trip_and_are_written_whole(tmp_path) -> None:
    store = open_module_store(f"file://{tmp_path / 'm'}")
    assert isinstance(store, LocalModuleStore) and isinstance(store, ModuleStore)
    store.put_many({KEY: b"\x00kv", KEY + "x": b""})
    assert store.get_many([KEY, "pc-rag/none", KEY + "x"]) == [b"\x00kv", None, b""]
    assert store.contains_many([KEY, "pc-rag/none"]) == [True, False]
    assert not [p for p in (tmp_path / "m").rglob("*") if p.name.endswith(".tmp")]  # no temp files left
    assert store.delete_many([KEY, KEY, "pc-rag/none"]) == 1 and store.get(KEY) is None


@pytest.mark.parametrize("key", ["../escape", "/abs", "a//b", "a/./b", "a b", ""])
def test_keys_that_could_leave_the_directory_are_refused(tmp_path, key: str) -> None:
    with pytest.raises(ModuleStoreError, match="is not a module key"):
        LocalModuleStore(tmp_path).put(key, b"x")


def test_a_damaged_module_is_refused(tmp_path) -> None:
    store = LocalModuleStore(tmp_path)
    store.put(KEY, b"0123456789" * 10)
    path = next(p for p in tmp_path.rglob("*.pcrm"))
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ModuleCorruptedError, match="damaged"):
        store.get(KEY)
    path.write_bytes(b"not a frame")
    with pytest.raises(ModuleCorruptedError, match="not a pc-rag module frame"):
        store.get(KEY)


def test_a_document_store_over_a_directory_of_modules(tmp_path, tokenizer) -> None:
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    kwargs = {"embedder": embedder(), "chunk_tokens": 24, "overlap_tokens": 4}
    with DocumentStore.create(tmp_path / "local", engine, **kwargs) as local:
        local.add_documents(DOCS, progress=False)
        expected = [c.kv.keys for c in local.chunks([local.handle(i) for i in sorted(local.manifest.chunks)])]
    with DocumentStore.create(tmp_path / "store", engine, modules=str(tmp_path / "modules"), **kwargs) as store:
        store.add_documents(DOCS, progress=False)
    assert len(list((tmp_path / "modules").rglob("*.pcrm"))) == len(expected)
    with DocumentStore.load(tmp_path / "store", engine, embedder=embedder()) as again:
        got = [c.kv.keys for c in again.chunks([again.handle(i) for i in sorted(again.manifest.chunks)])]
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(StoreError, match="keeps its KV in its own shards"):
        DocumentStore.load(tmp_path / "local", engine, embedder=embedder(), modules=str(tmp_path / "modules"))
    with pytest.raises(StoreError, match="recompute_missing"):
        DocumentStore.load(tmp_path / "local", engine, embedder=embedder(), recompute_missing=True)


def test_compressed_modules_are_written_per_level_and_read_like_a_compressed_store(
    tmp_path, tokenizer, monkeypatch
) -> None:
    from pc_rag.codec import fit_tables
    from pc_rag.rag.tuned import codec_tables_file

    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    monkeypatch.setenv("PC_RAG_CACHE", str(tmp_path / "cache"))
    chunks = engine.encode([text for text, _ in DOCS] * 3, "naive")
    (tmp_path / "cache" / "tuned").mkdir(parents=True)
    fit_tables([(c.kv.keys, c.kv.values) for c in chunks], engine.lm.fingerprint()).save(
        tmp_path / "cache" / "tuned" / codec_tables_file(engine.lm.fingerprint())
    )
    kwargs = {"embedder": embedder(), "chunk_tokens": 24, "overlap_tokens": 4, "codec": "cachegen:2,5"}
    with DocumentStore.create(tmp_path / "shards", engine, **kwargs) as shards:
        shards.add_documents(DOCS, progress=False)
        expected = [c.kv.keys for c in shards.chunks([shards.handle(i) for i in sorted(shards.manifest.chunks)])]
    with DocumentStore.create(tmp_path / "store", engine, modules=str(tmp_path / "m"), **kwargs) as store:
        store.add_documents(DOCS, progress=False)
        got = [c.kv.keys for c in store.chunks([store.handle(i) for i in sorted(store.manifest.chunks)])]
        assert len(list((tmp_path / "m").rglob("*.pcrm"))) == 2 * len(store)  # one module per level
        assert all(v.endswith(h) for (v, _), h in zip(store.kv.get_many_versioned(sorted(store.manifest.chunks)),
                   [r.content_hash for _, r in sorted(store.manifest.chunks.items())], strict=True))  # fmt: skip
    for a, b in zip(expected, got, strict=True):  # level 5, decoded from the same CacheGen bytes
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_package_exports_it_as_the_docs_show() -> None:
    import pc_rag.modules
    from pc_rag.modules import LocalModuleStore as exported

    assert exported is LocalModuleStore and "LocalModuleStore" in pc_rag.modules.__all__
