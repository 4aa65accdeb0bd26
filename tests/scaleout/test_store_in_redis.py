"""A document store whose chunk KV lives in a real Redis: same KV and answers as local shards, shared across
stores and processes, resumed by content hash, and safe when Redis stops, restarts empty or runs out of memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import redis
import torch
from conftest import tiny_model
from test_document_store import DOCS, embedder

from pc_rag.errors import ModuleStoreError, ModuleStoreFullError, ModuleStoreUnavailableError, StoreCorruptedError
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.scaleout.local_redis import RedisServer
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.files import bytes_on_disk

QUESTION = "Which mountain is the highest of Japan?"
WORKER = Path(__file__).with_name("store_reader.py")


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer), RagPrompt())


def build(directory: Path, engine: RagEngine, **kwargs) -> DocumentStore:
    store = DocumentStore.create(directory, engine, embedder=embedder(), chunk_tokens=24, overlap_tokens=4, **kwargs)
    store.add_documents(DOCS, ids=["eiffel", "fuji", "danube"], progress=False)
    return store


def kv_of(store: DocumentStore) -> list[torch.Tensor]:
    return [c.kv.keys for c in store.chunks([store.handle(cid) for cid in sorted(store.manifest.chunks)])]


def count_encodes(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = RagEngine.encode_token_ids

    def counted(self, token_ids, *args, **kwargs):
        calls.append(len(token_ids))
        return real(self, token_ids, *args, **kwargs)

    monkeypatch.setattr(RagEngine, "encode_token_ids", counted)
    return calls


def test_kv_and_answers_equal_the_local_store(tmp_path, engine, redis_url) -> None:
    with build(tmp_path / "local", engine) as local, build(tmp_path / "remote", engine, modules=redis_url) as remote:
        assert not list((tmp_path / "remote" / "kv").glob("*")) and remote.manifest.modules == redis_url
        assert redis.Redis.from_url(redis_url).dbsize() == len(remote) == len(local)
        for a, b in zip(kv_of(local), kv_of(remote), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        answers = [PromptServer(store=s).answer(QUESTION, k=2, max_new_tokens=6) for s in (local, remote)]
        assert answers[0].text == answers[1].text and answers[0].result.token_ids == answers[1].result.token_ids
        assert remote.verify()


def test_a_second_store_on_the_same_redis_encodes_nothing(tmp_path, engine, redis_url, monkeypatch) -> None:
    build(tmp_path / "first", engine, modules=redis_url).close()
    calls = count_encodes(monkeypatch)
    with build(tmp_path / "second", engine, modules=redis_url) as second:  # resumes by content hash
        assert calls == [] and len(second) > 0
        with DocumentStore.load(tmp_path / "first", engine, embedder=embedder()) as first:
            for a, b in zip(kv_of(first), kv_of(second), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert calls == []


def test_another_process_answers_from_the_modules_without_encoding(tmp_path, engine, redis_url) -> None:
    with build(tmp_path / "store", engine, modules=redis_url) as store:
        expected = PromptServer(store=store).answer(QUESTION, k=2, max_new_tokens=6)
    done = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "store"), redis_url, QUESTION],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:2] == ["encoded 0", repr(expected.result.token_ids)]


def test_redis_stopped_mid_query_is_a_clear_error_or_a_recompute(tmp_path, engine, tmp_path_factory) -> None:
    with RedisServer(tmp_path_factory.mktemp("own-redis")) as own:
        build(tmp_path / "store", engine, modules=own.url).close()
        with DocumentStore.load(tmp_path / "store", engine, embedder=embedder()) as store:
            exact = kv_of(store)
        own.stop()
        unreachable = pytest.raises(ModuleStoreUnavailableError, match=f"127.0.0.1:{own.port}.*unreachable")
        with DocumentStore.load(tmp_path / "store", engine, embedder=embedder()) as store, unreachable:
            kv_of(store)
        with DocumentStore.load(tmp_path / "store", engine, embedder=embedder(), recompute_missing=True) as store:
            for a, b in zip(exact, kv_of(store), strict=True):  # encoded again from the text: the same KV
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            versions = store.kv.get_many_versioned(sorted(store.manifest.chunks))
            assert all(v.startswith("recomputed/") for v, _ in versions)
        own.start()  # restarted empty (no persistence): every module is missing
        with DocumentStore.load(tmp_path / "store", engine, embedder=embedder()) as store:
            with pytest.raises(ModuleStoreError, match="missing from the module store"):
                kv_of(store)
            with pytest.raises(StoreCorruptedError, match="have no module"):
                store.verify()
        with DocumentStore.load(tmp_path / "store", engine, embedder=embedder(), recompute_missing=True) as store:
            for a, b in zip(exact, kv_of(store), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_redis_out_of_memory_is_a_clear_error_and_leaves_the_store(tmp_path, engine, tmp_path_factory) -> None:
    limits = ("--maxmemory", "1mb", "--maxmemory-policy", "noeviction")
    with RedisServer(tmp_path_factory.mktemp("full-redis"), *limits) as full:
        store = DocumentStore.create(tmp_path / "store", engine, embedder=embedder(), chunk_tokens=24,
                                     overlap_tokens=4, modules=full.url)  # fmt: skip
        with store:
            store.add_documents(DOCS[:1], ids=["eiffel"], progress=False)
            before = ((tmp_path / "store" / "manifest.json").read_bytes(), bytes_on_disk(tmp_path / "store"))
            many = [(f"{text} Copy {i} of it, with other words {i * 7}.", {}) for i in range(400) for text, _ in DOCS]
            with pytest.raises(ModuleStoreFullError, match="out of memory"):
                store.add_documents(many, progress=False)
            assert ((tmp_path / "store" / "manifest.json").read_bytes(), bytes_on_disk(tmp_path / "store")) == before
            assert sorted(store.manifest.docs) == ["eiffel"] and len(kv_of(store)) == len(store)
