"""Store transactions in one process: one writer, read-only loads, commits that readers follow, nothing lost.

The multi-process side (kill -9, readers during an index) is ``test_store_crash.py``.
"""

from __future__ import annotations

import itertools
import json
import threading

import numpy as np
import pytest
from conftest import tiny_model
from test_document_store import DOCS, bag_of_words, embedder, make_store

from pc_rag.errors import StoreCorruptedError, StoreError, StoreLockedError
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store import as_embedder
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.files import LEGACY_INDEX_NAME
from pc_rag.store.manifest import FORMAT_VERSION


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer), RagPrompt())


def load(tmp_path, engine: RagEngine) -> DocumentStore:
    return DocumentStore.load(tmp_path / "store", engine, embedder=embedder())


def edit_manifest(tmp_path, change) -> None:
    path = tmp_path / "store" / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_one_writer_at_a_time_readers_never_wait(tmp_path, engine: RagEngine) -> None:
    writer = make_store(tmp_path, engine)
    reader = load(tmp_path, engine)
    assert reader.search("Which mountain is the highest of Japan?", k=1)[0].doc_id == "fuji"
    with pytest.raises(StoreLockedError, match="being written"):
        reader.add_documents(["The Nile is long."], progress=False)
    assert reader.documents == ["eiffel", "fuji", "danube"]  # the refused write changed nothing
    writer.close()
    reader.add_documents(["The Nile is long."], ["nile"], progress=False)
    reader.close()


def test_a_writer_catches_up_with_commits_made_since_it_loaded(tmp_path, engine: RagEngine) -> None:
    writer = make_store(tmp_path, engine)
    late = load(tmp_path, engine)  # loaded before the next commit
    writer.add_documents(["The Nile is long."], ["nile"], progress=False)
    writer.close()
    late.add_documents(["The Amazon is wide."], ["amazon"], progress=False)
    assert sorted(load(tmp_path, engine).documents) == ["amazon", "danube", "eiffel", "fuji", "nile"]


def test_readers_follow_commits(tmp_path, engine: RagEngine) -> None:
    writer = make_store(tmp_path, engine)
    reader = load(tmp_path, engine)
    writer.add_documents(["The Nile river flows through Egypt."], ["nile"], progress=False)
    writer.delete(["fuji"])
    assert [h.doc_id for h in reader.search("Nile river Egypt", k=1)] == ["nile"]
    assert "fuji" not in reader.documents
    PromptServer(store=reader).answer("Where does the Nile flow?", k=2, max_new_tokens=2)


def test_delete_without_save_stays_uncommitted(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine)
    store.delete(["fuji"], save=False)
    assert "fuji" not in store.documents and "fuji" in load(tmp_path, engine).documents
    store.close()  # drops the uncommitted delete
    assert "fuji" in load(tmp_path, engine).documents


def test_a_failed_update_keeps_the_old_version(tmp_path, engine: RagEngine, monkeypatch) -> None:
    store = make_store(tmp_path, engine)
    old = store.search("Eiffel Tower Paris", k=1)[0]

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("encoder failed")

    monkeypatch.setattr(store.engine, "encode_token_ids", broken)
    with pytest.raises(RuntimeError, match="encoder failed"):
        store.update("eiffel", "The Eiffel Tower is 330 metres tall.")
    for view in (store, load(tmp_path, engine)):
        assert view.search("Eiffel Tower Paris", k=1)[0].text == old.text
        assert view.manifest.docs["eiffel"].chunk_ids == (old.chunk_id, *view.manifest.docs["eiffel"].chunk_ids[1:])
    monkeypatch.undo()
    store.update("eiffel", "The Eiffel Tower is 330 metres tall.")
    assert store.search("How tall is the Eiffel Tower?", k=1)[0].text == "The Eiffel Tower is 330 metres tall."


def test_unchanged_documents_are_skipped(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine)
    shards, next_id = dict(store.manifest.shards), store.manifest.next_chunk_id()
    store.add_documents(DOCS, ids=["eiffel", "fuji", "danube"], progress=False)
    assert store.manifest.shards == shards and store.manifest.next_chunk_id() == next_id
    store.add_documents([(DOCS[0][0], {"source": "moved.txt"})], ids=["eiffel"], progress=False)  # metadata changed
    assert store.manifest.next_chunk_id() > next_id and store.handle(store.manifest.docs["eiffel"].chunk_ids[0])


def test_chunk_ids_are_never_reused(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine)
    danube = store.manifest.docs["danube"].chunk_ids
    store.delete(["danube"])
    store.compact()
    assert not set(danube) & {c for s in store.manifest.shards.values() for c in s.chunk_ids}
    store.add_documents(["The Nile is long."], ["nile"], progress=False)
    assert min(store.manifest.docs["nile"].chunk_ids) > max(danube)  # a reader's cached KV for them stays wrong-free


def test_concurrent_adds_from_threads(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine)
    errors: list[BaseException] = []

    def add(t: int) -> None:
        try:
            for i in range(3):
                store.add_documents([f"Note {t}-{i} about lake number {t * 10 + i}."], [f"n{t}-{i}"], progress=False)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=add, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    ids = [c for d in store.manifest.docs.values() for c in d.chunk_ids]
    assert len(ids) == len(set(ids)) == len(store) and len(store.documents) == 3 + 12
    load(tmp_path, engine).verify()


def test_the_index_file_is_checksummed(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine)
    path = tmp_path / "store" / store.manifest.index.name
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(StoreCorruptedError, match="does not match its checksum"):
        load(tmp_path, engine)


@pytest.mark.parametrize("name", ["../../outside.safetensors", "/etc/passwd", "kv/../manifest.json"])
def test_shard_names_cannot_leave_the_store(tmp_path, engine: RagEngine, name: str) -> None:
    make_store(tmp_path, engine)
    edit_manifest(tmp_path, lambda d: d["shards"].update({name: next(iter(d["shards"].values()))}))
    with pytest.raises(StoreCorruptedError, match="not a shard name"):
        load(tmp_path, engine)


def test_an_unknown_storage_dtype_is_named(tmp_path, engine: RagEngine) -> None:
    make_store(tmp_path, engine)
    edit_manifest(tmp_path, lambda d: d["identity"].update(model_dtype="float32/Tensor"))
    with pytest.raises(StoreCorruptedError, match="storage dtype 'Tensor'"):
        load(tmp_path, engine)


def test_create_refuses_a_file_or_a_foreign_directory(tmp_path, engine: RagEngine) -> None:
    (tmp_path / "file").write_text("mine")
    with pytest.raises(StoreError, match="is a file"):
        DocumentStore.create(tmp_path / "file", engine, embedder=embedder())
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match="not empty"):
        DocumentStore.create(tmp_path / "mine", engine, embedder=embedder())
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    for chunk_tokens, overlap in [(0, 0), (16, 16), (16, -1)]:
        with pytest.raises(StoreError, match="chunk_tokens must be"):
            DocumentStore.create(tmp_path / "new", engine, embedder=embedder(), chunk_tokens=chunk_tokens,
                                 overlap_tokens=overlap)  # fmt: skip
    assert not (tmp_path / "new").exists()  # nothing created for a store that could never take a document


def test_a_format_1_store_loads_and_is_upgraded_by_its_next_commit(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine)
    store.close()
    (tmp_path / "store" / store.manifest.index.name).rename(tmp_path / "store" / LEGACY_INDEX_NAME)
    edit_manifest(
        tmp_path, lambda d: [d.pop(k) for k in ("index", "generation", "next_id")] + [d.update(format_version=1)]
    )
    old = load(tmp_path, engine)
    assert old.search("Which mountain is the highest of Japan?", k=1)[0].doc_id == "fuji"
    old.delete(["danube"])
    assert not (tmp_path / "store" / LEGACY_INDEX_NAME).exists()
    assert json.loads((tmp_path / "store" / "manifest.json").read_text())["format_version"] == FORMAT_VERSION
    load(tmp_path, engine).verify()


def test_an_add_also_commits_by_time_so_an_interrupted_one_keeps_what_it_encoded(tmp_path, engine) -> None:
    store = DocumentStore.create(tmp_path / "store", engine, embedder=embedder(), chunk_tokens=24, overlap_tokens=4)
    ticks = itertools.count(step=31.0)  # each reading of the clock is 31 s after the one before
    embedded: list[int] = []

    def interrupted(texts: list[str]) -> np.ndarray:
        if len(embedded) == 2:
            raise KeyboardInterrupt  # killed during the third batch of chunks
        embedded.append(len(texts))
        return bag_of_words(texts)

    store.embedder = as_embedder(interrupted, name="test-bag-of-words")
    docs = [f"Note {i} about the river Rhine." for i in range(100)]  # far fewer chunks than commit_every
    with pytest.raises(KeyboardInterrupt):
        store.add_documents(docs, progress=False, commit_every=512, commit_seconds=30, clock=lambda: next(ticks))
    store.close()
    reopened = load(tmp_path, engine)
    kept = len(reopened.manifest.chunks)
    assert kept == sum(embedded) > 0 and reopened.manifest.generation >= 3  # a commit after each part
    assert "sound" in reopened.verify()
    reopened.embedder = embedder()
    before = reopened.manifest.next_chunk_id()
    reopened.add_documents(docs, progress=False)  # the rerun encodes only what the interrupted one had not
    assert reopened.manifest.next_chunk_id() - before == len(reopened.manifest.chunks) - kept
    reopened.close()
