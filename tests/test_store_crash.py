"""A store survives ``kill -9`` of its writer at every step, and readers in other processes never see a torn state.

The writer runs in a real child process (``tests/store_worker.py``) that SIGKILLs itself at a chosen write
step. Afterwards: loading writes nothing, every committed document answers, no chunk is served twice, and
finishing the job (rerunning it) leaves a store that ``verify`` finds sound, with no leftover files.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from store_worker import document, engine, open_store
from test_document_store import embedder

from pc_rag.errors import StoreLockedError
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore

WORKER = Path(__file__).parent / "store_worker.py"
DOCS = 8


def run_worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=300)


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.rglob("*")}


@pytest.fixture(scope="module")
def eng():
    return engine()


def check_committed(store: DocumentStore, version: int) -> None:
    """Every listed document is whole, at one version, retrievable, and no chunk appears twice."""
    handles = store.search("famous colour", k=len(store) + 5)
    assert len({h.chunk_id for h in handles}) == len(handles) == len(store)
    for doc_id, record in store.manifest.docs.items():
        text = "".join(store.manifest.chunks[c].text for c in record.chunk_ids)
        assert f"(version {version})" in text or f"(version {1 - version})" in text, doc_id
        assert store.chunks([store.handle(c) for c in record.chunk_ids])  # its KV is there and well-formed
    PromptServer(store=store).answer("Which river is famous?", k=2, mode="naive", max_new_tokens=2)


@pytest.mark.parametrize("kill_at", ["shard:2", "index:2", "manifest:2", "after-manifest:2", "shard:3"])
def test_kill_9_during_index_loses_no_committed_document(tmp_path, eng, kill_at) -> None:
    store_dir = tmp_path / "store"
    killed = run_worker("write", "--store", str(store_dir), "--docs", str(DOCS), "--kill-at", kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]

    before = snapshot(store_dir)
    with DocumentStore.load(store_dir, eng, embedder=embedder()) as store:
        committed = dict(store.manifest.docs)
        check_committed(store, version=0)
    assert snapshot(store_dir) == before  # loading and asking wrote nothing

    finished = run_worker("write", "--store", str(store_dir), "--docs", str(DOCS))
    assert finished.returncode == 0, finished.stderr[-2000:]
    with open_store(store_dir, eng) as store:
        assert sorted(store.manifest.docs) == sorted(f"doc{i}" for i in range(DOCS))
        for doc_id, record in committed.items():  # committed before the kill: kept, not encoded again
            assert store.manifest.docs[doc_id] == record
        check_committed(store, version=0)
        assert "leftover" not in store.verify()  # every checksum and reference sound, no file of the killed writer


@pytest.mark.parametrize("kill_at", ["shard:1", "manifest:1"])
def test_kill_9_during_update_keeps_the_old_version(tmp_path, eng, kill_at) -> None:
    store_dir = tmp_path / "store"
    killed = run_worker(
        "write", "--store", str(store_dir), "--docs", "4", "--update", "--commit-every", "100", "--kill-at", kill_at
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    with open_store(store_dir, eng) as store:
        assert sorted(store.manifest.docs) == [f"doc{i}" for i in range(4)]
        for record in store.manifest.docs.values():
            assert "(version 0)" in store.manifest.chunks[record.chunk_ids[0]].text
        check_committed(store, version=0)


def test_readers_in_a_loop_while_a_writer_indexes(tmp_path, eng) -> None:
    store_dir, done = tmp_path / "store", tmp_path / "writer-done"
    reader = subprocess.Popen(
        [sys.executable, str(WORKER), "read", "--store", str(store_dir), "--until", str(done)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        writer = run_worker("write", "--store", str(store_dir), "--docs", "24", "--commit-every", "2")
    finally:
        done.touch()
        out, err = reader.communicate(timeout=300)
    assert writer.returncode == 0, writer.stderr[-2000:]
    assert out.startswith("ok "), out + err[-2000:]
    assert int(out.split()[1]) >= 3  # the reader really asked while the writer committed
    with open_store(store_dir, eng) as store:
        assert len(store.manifest.docs) == 24
        store.verify()


def test_a_second_writer_process_is_refused_while_readers_go_on(tmp_path, eng) -> None:
    store_dir = tmp_path / "store"
    with open_store(store_dir, eng) as writer:
        writer.add_documents([document(0)], ["doc0"], progress=False)  # holds the writer lock from here on
        other = run_worker("write", "--store", str(store_dir), "--docs", "2")
        assert other.returncode != 0 and "StoreLockedError" in other.stderr
        reader = DocumentStore.load(store_dir, eng, embedder=embedder())
        assert [h.doc_id for h in reader.search("river", k=1)] == ["doc0"]
        with pytest.raises(StoreLockedError, match="being written"):
            reader.delete(["doc0"])
    reader.delete(["doc0"])  # the lock was released with the writer
    reader.close()
