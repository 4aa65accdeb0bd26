"""A document store whose KV is CacheGen-compressed: built with the model's tables, self-contained, answering."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_document_store import DOCS, embedder

from pc_rag.bench.memory import kv_footprint
from pc_rag.codec import CacheGenCodec, fit_tables
from pc_rag.errors import StoreCorruptedError, StoreError
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.tuned import codec_tables_file
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.files import unlisted


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer), RagPrompt())


@pytest.fixture
def tables_in_cache(tmp_path, monkeypatch, engine: RagEngine):
    """The tiny model's tables, fitted on its own chunks, where stores look for them."""
    monkeypatch.setenv("PC_RAG_CACHE", str(tmp_path / "cache"))
    chunks = engine.encode([text for text, _ in DOCS] * 3, "naive")
    tables = fit_tables([(c.kv.keys, c.kv.values) for c in chunks], engine.lm.fingerprint())
    (tmp_path / "cache" / "tuned").mkdir(parents=True)
    tables.save(tmp_path / "cache" / "tuned" / codec_tables_file(engine.lm.fingerprint()))
    return tables


def build(path, engine: RagEngine, codec: str | None) -> DocumentStore:
    store = DocumentStore.create(path, engine, embedder=embedder(), chunk_tokens=24, overlap_tokens=4, codec=codec)
    store.add_documents(DOCS, ids=["eiffel", "fuji", "danube"], progress=False)
    return store


def test_a_compressed_store_answers_like_the_raw_one_from_less_disk(tmp_path, engine, tables_in_cache) -> None:
    with build(tmp_path / "raw", engine, None) as raw, build(tmp_path / "cg", engine, "cachegen:2,5") as cg:
        assert cg.kv.nbytes < raw.kv.nbytes / 2
        question = "Which mountain is the highest of Japan?"
        assert [h.chunk_id for h in cg.search(question, k=2)] == [h.chunk_id for h in raw.search(question, k=2)]
        want = PromptServer(store=raw).answer(question, k=2, mode="naive", max_new_tokens=6)
        got = PromptServer(store=cg).answer(question, k=2, mode="naive", max_new_tokens=6)
        assert got.text and got.sources == want.sources
    again = DocumentStore.load(tmp_path / "cg", engine, embedder=embedder())
    assert again.manifest.codec_levels == (2, 5) and not unlisted(tmp_path / "cg", again.manifest.listed_files())
    chunk_id = again.manifest.docs["fuji"].chunk_ids[0]
    chunk = again.chunks([again.handle(chunk_id)])[0]
    exact = engine.encode_token_ids([list(chunk.token_ids)], chunk.conditioned)[0].kv
    fine, coarse = again.kv.get(chunk_id), again.kv.get(chunk_id, level=2)
    err = [float((s.keys.float() - exact.keys.float()).abs().mean()) for s in (fine, coarse)]
    assert err[0] < err[1], err


def test_a_compressed_store_needs_tables_and_keeps_them_checked(tmp_path, engine, tables_in_cache) -> None:
    with build(tmp_path / "cg", engine, "cachegen") as store:
        tables_file = tmp_path / "cg" / store.manifest.codec_tables.name
    data = bytearray(tables_file.read_bytes())
    data[-5] ^= 0xFF
    tables_file.write_bytes(bytes(data))
    with pytest.raises(StoreCorruptedError, match="do not match their checksum"):
        DocumentStore.load(tmp_path / "cg", engine, embedder=embedder())
    (tmp_path / "cache" / "tuned" / codec_tables_file(engine.lm.fingerprint())).unlink()
    with pytest.raises(StoreError, match="pc-rag tune-codec"):
        build(tmp_path / "none", engine, "cachegen")
    with pytest.raises(StoreError, match="--codec takes"):
        build(tmp_path / "bad", engine, "zip:3")


def test_bench_memory_measures_every_level_on_disk(engine, tables_in_cache) -> None:
    raw, *levels = kv_footprint(engine, [torch.bfloat16], documents=3, levels=[1, 3, 5])
    assert [r.codec for r in levels] == ["cachegen:1", "cachegen:3", "cachegen:5"]
    sizes = [r.disk_bytes_per_token for r in levels]
    assert sizes == sorted(sizes) and sizes[-1] < raw.disk_bytes_per_token
    assert all(r.tokens == raw.tokens for r in levels)


def test_a_raw_store_is_re_encoded_in_place_at_once(tmp_path, engine, tables_in_cache, monkeypatch) -> None:
    with build(tmp_path / "s", engine, None) as store:
        before = {c: store.kv.get(c).keys.clone() for c in store.kv.ids()}
        raw_bytes = store.kv.nbytes
        calls = {"n": 0}
        real_encode = CacheGenCodec.encode

        def failing(self, span, level):  # the third chunk fails: nothing may change
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("disk full")
            return real_encode(self, span, level)

        monkeypatch.setattr(CacheGenCodec, "encode", failing)
        with pytest.raises(RuntimeError, match="disk full"):
            store.recode("cachegen:2,5", progress=False)
        assert store.manifest.codec_levels == () and store.kv.nbytes == raw_bytes
        monkeypatch.setattr(CacheGenCodec, "encode", real_encode)
        store.recode("cachegen:2,5", progress=False)
        assert store.manifest.codec_levels == (2, 5) and store.kv.nbytes < raw_bytes / 2
        with pytest.raises(StoreError, match="already compressed"):
            store.recode("cachegen:3", progress=False)
    again = DocumentStore.load(tmp_path / "s", engine, embedder=embedder())
    assert not unlisted(tmp_path / "s", again.manifest.listed_files())
    assert set(again.kv.ids()) == set(before) and all(again.kv.compressed_levels(c) == (2, 5) for c in before)
    assert again.search("Which mountain is the highest of Japan?", k=1)[0].doc_id == "fuji"
