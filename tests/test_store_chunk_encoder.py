"""A store knows which splice adapter encoding side made its chunk KV: it records it, its chunks carry it, a mode
that reads chunks otherwise is refused in one line naming `pc-rag store reencode`, and re-encoding fixes it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model
from test_cli_store_commands import cli_home, run
from test_document_store import DOCS, embedder, make_store

from pc_rag import model
from pc_rag.errors import StoreError
from pc_rag.model import LoadedModel
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.adapter import AdapterConfig, SpliceAdapter
from pc_rag.rag.engine import ChunkEncodingError
from pc_rag.rag.order import BEST_FIRST
from pc_rag.rag.tuned import adapter_file
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore, module_text
from pc_rag.store.manifest import MANIFEST_NAME, Manifest

QUESTION = "Where is the Eiffel Tower?"


@pytest.fixture
def lm(tokenizer) -> LoadedModel:
    return tiny_model("llama", tokenizer)  # fresh per test: an engine's adapter hooks into its model


def encoding_adapter(lm: LoadedModel, seed: int = 0) -> SpliceAdapter:
    """A splice adapter with an encoding side of its own, both sides nonzero."""
    torch.manual_seed(seed)
    made = SpliceAdapter(lm.model, AdapterConfig(rank=2, encoding="separate"), lm.fingerprint())
    with torch.no_grad():
        for p in [*made.lora_b.values(), *made.encode_b.values()]:
            p.normal_(0, 0.05)
    return made.requires_grad_(False)


def all_chunks(store: DocumentStore):
    return store.chunks([store.handle(c) for c in sorted(store.manifest.chunks)])


def fresh_answer(engine: RagEngine, store: DocumentStore, mode: str) -> list[int]:
    """The answer from the store's top chunks encoded now, for ``mode``, by the engine itself."""
    handles = store.search(QUESTION, k=2)
    chunks = engine.encode([module_text(h.text) for h in handles], mode)
    return engine.answer(chunks, QUESTION, mode, max_new_tokens=4).token_ids


def store_answer(store: DocumentStore, mode: str) -> list[int]:
    chunks = store.chunks(store.search(QUESTION, k=2))
    return store.engine.answer(chunks, QUESTION, mode, max_new_tokens=4).token_ids


def test_a_fast_store_records_the_adapters_encoding_and_its_chunks_carry_it(tmp_path, lm) -> None:
    adapter = encoding_adapter(lm)
    engine = RagEngine(lm, RagPrompt(), adapter=adapter)
    fast = make_store(tmp_path / "fast", engine, mode="fast")
    assert adapter.encoding_digest and fast.manifest.identity.chunk_encoder == adapter.encoding_digest
    assert Manifest.load(tmp_path / "fast" / "store" / MANIFEST_NAME).identity.chunk_encoder == adapter.encoding_digest
    assert {c.encoder for c in all_chunks(fast)} == {adapter.encoding_digest}
    plain = make_store(tmp_path / "plain", engine, mode="prefix")  # the same conditioning, no encoding side
    assert plain.manifest.identity.chunk_encoder == "" and {c.encoder for c in all_chunks(plain)} == {""}
    for a, b in zip(all_chunks(fast), all_chunks(plain), strict=True):
        assert a.token_ids == b.token_ids and not torch.allclose(a.kv.keys, b.kv.keys)
    assert store_answer(fast, "fast") == fresh_answer(engine, fast, "fast")


def test_serving_fast_from_a_plain_store_names_the_reencode_command(tmp_path, lm) -> None:
    engine = RagEngine(lm, RagPrompt(), adapter=encoding_adapter(lm))
    store = make_store(tmp_path, engine, mode="prefix")
    server = PromptServer(store=store)
    server.answer(QUESTION, k=2, max_new_tokens=1)  # its own mode reads its chunks
    command = f"`pc-rag store reencode --store {tmp_path / 'store'} --mode fast`"
    with pytest.raises(ChunkEncodingError, match="pc-rag store reencode") as info:
        server.answer(QUESTION, k=2, mode="fast", max_new_tokens=1)
    assert command in str(info.value) and "\n" not in str(info.value)
    assert "encoded by the plain model" in str(info.value)
    reference = f"{engine.prompt.preamble}{store.module_ref(store.handle(0))}\nWhat is it?"
    with pytest.raises(ChunkEncodingError, match="pc-rag store reencode --store"):
        server.request(reference, mode="fast", max_new_tokens=1)
    engine_says = "pc-rag store reencode --store STORE --mode fast"  # the engine's own check, for any chunks
    with pytest.raises(ChunkEncodingError, match=engine_says):
        engine.answer(store.chunks(store.search(QUESTION, k=1)), QUESTION, "fast", max_new_tokens=1)


def test_reencode_makes_the_mode_servable_with_the_answer_of_fresh_chunks(tmp_path, lm) -> None:
    adapter = encoding_adapter(lm)
    engine = RagEngine(lm, RagPrompt(), adapter=adapter)
    store = make_store(tmp_path, engine, mode="prefix")
    shards = set(store.manifest.shards)
    report = store.reencode("fast", progress=False)
    assert report.chunks == len(store) and report.mode == "fast" and report.seconds >= 0
    assert str(report).startswith(f"re-encoded {len(store)} chunks") and adapter.encoding_digest in str(report)
    again = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())
    identity = again.manifest.identity
    assert (identity.encoding_mode, identity.chunk_encoder) == ("fast/conditioned", adapter.encoding_digest)
    assert again.mode == "fast" and again.manifest.serving == {"adapter": adapter.digest}
    assert not shards & set(again.manifest.shards)  # the plain KV is retired, and its files removed
    assert not any((tmp_path / "store" / name).exists() for name in shards)
    assert "every checksum and reference is sound" in again.verify()
    assert store_answer(again, "fast") == fresh_answer(engine, again, "fast")
    served = PromptServer(store=again).answer(QUESTION, k=2, order=BEST_FIRST, max_new_tokens=4)
    assert served.result.token_ids == fresh_answer(engine, again, "fast")
    with pytest.raises(ChunkEncodingError, match="--mode prefix"):  # the other way now
        again.check_mode("prefix")


def test_reencode_switches_between_conditioned_and_isolated_modes(tmp_path, lm) -> None:
    engine = RagEngine(lm, RagPrompt())
    store = make_store(tmp_path, engine, mode="prefix")
    store.reencode("naive", progress=False)
    again = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())
    assert again.manifest.identity.encoding_mode == "naive/isolated" and again.mode == "naive"
    assert {c.conditioned for c in all_chunks(again)} == {False}
    assert store_answer(again, "naive") == fresh_answer(engine, again, "naive")
    with pytest.raises(StoreError, match="unknown"):
        store.reencode("no-such-mode", progress=False)


def test_a_store_loads_after_the_adapter_changed_but_serving_and_adding_refuse(tmp_path, lm, caplog) -> None:
    first, second = encoding_adapter(lm, 0), encoding_adapter(lm, 1)
    assert first.encoding_digest != second.encoding_digest
    store = make_store(tmp_path, RagEngine(lm, RagPrompt(), adapter=first), mode="fast")
    store.close()
    first.detach()
    engine = RagEngine(lm, RagPrompt(), adapter=second)
    with caplog.at_level("WARNING"):
        loaded = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())  # it loads
    assert "pc-rag store reencode" in caplog.text and "KV is still valid" not in caplog.text
    with pytest.raises(ChunkEncodingError, match=f"--store {tmp_path / 'store'} --mode fast") as info:
        PromptServer(store=loaded).answer(QUESTION, k=2, max_new_tokens=1)
    assert first.encoding_digest in str(info.value) and second.encoding_digest in str(info.value)
    generation = loaded.manifest.generation
    with pytest.raises(ChunkEncodingError, match="pc-rag store reencode --store") as info:
        loaded.add_documents([("A new document about the Rhine.", {})], ids=["rhine"], progress=False)
    assert "\n" not in str(info.value)
    assert "rhine" not in loaded.manifest.docs and loaded.manifest.generation == generation
    loaded.add_documents(DOCS[:1], ids=["eiffel"], progress=False)  # unchanged: nothing to encode, nothing refused
    loaded.close()
    reopened = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())
    assert reopened.manifest.generation == generation and "rhine" not in reopened.manifest.docs
    reopened.reencode(progress=False)  # the store's own mode, by the adapter the model has now
    assert reopened.manifest.identity.chunk_encoder == second.encoding_digest
    reopened.add_documents([("A new document about the Rhine.", {})], ids=["rhine"], progress=False)
    assert {c.encoder for c in all_chunks(reopened)} == {second.encoding_digest}
    assert store_answer(reopened, "fast") == fresh_answer(engine, reopened, "fast")


def test_a_manifest_written_before_chunk_encoders_loads_as_plain(tmp_path, lm) -> None:
    engine = RagEngine(lm, RagPrompt(), adapter=encoding_adapter(lm))
    make_store(tmp_path, engine, mode="prefix").close()
    path = tmp_path / "store" / MANIFEST_NAME
    data = json.loads(path.read_text())
    del data["identity"]["chunk_encoder"]
    data["format_version"] = 5
    path.write_text(json.dumps(data))
    store = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())
    assert store.manifest.identity.chunk_encoder == "" and {c.encoder for c in all_chunks(store)} == {""}
    assert store_answer(store, "prefix") == fresh_answer(engine, store, "prefix")
    with pytest.raises(ChunkEncodingError, match="pc-rag store reencode"):
        store.check_mode("fast")


def test_a_failed_reencode_commit_leaves_the_store_as_it_was(tmp_path, lm, monkeypatch) -> None:
    engine = RagEngine(lm, RagPrompt(), adapter=encoding_adapter(lm))
    store = make_store(tmp_path, engine, mode="prefix")
    before = (store.manifest.identity, dict(store.manifest.shards), store.manifest.generation)
    answer = store_answer(store, "prefix")

    def crash(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(Manifest, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        store.reencode("fast", progress=False)
    monkeypatch.undo()
    assert (store.manifest.identity, dict(store.manifest.shards), store.manifest.generation) == before
    assert store.mode == "prefix" and store_answer(store, "prefix") == answer
    shard_files = {p.relative_to(tmp_path / "store").as_posix() for p in (tmp_path / "store" / "kv").iterdir()}
    assert shard_files == set(before[1])  # the new shards are gone
    again = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())
    assert again.manifest.identity == before[0] and store_answer(again, "prefix") == answer


def test_a_module_store_reencodes_into_modules_of_the_new_encoding(tmp_path, lm) -> None:
    adapter = encoding_adapter(lm)
    engine = RagEngine(lm, RagPrompt(), adapter=adapter)
    modules = str(tmp_path / "modules")
    store = make_store(tmp_path / "a", engine, mode="prefix", modules=modules)
    plain = [c.kv.keys for c in all_chunks(store)]
    report = store.reencode("fast", progress=False)
    assert (report.chunks, report.reused) == (len(store), 0)
    again = DocumentStore.load(tmp_path / "a" / "store", engine, embedder=embedder())
    assert again.manifest.identity.chunk_encoder == adapter.encoding_digest
    assert not any(torch.allclose(c.kv.keys, k) for c, k in zip(all_chunks(again), plain, strict=True))
    assert store_answer(again, "fast") == fresh_answer(engine, again, "fast")
    other = make_store(tmp_path / "b", engine, mode="prefix", modules=modules)  # plain, on the same backend
    assert all(torch.equal(c.kv.keys, k) for c, k in zip(all_chunks(other), plain, strict=True))
    assert other.reencode("fast", progress=False).reused == len(other)  # modules of that encoding are there


def test_a_scaleout_worker_encodes_with_the_stores_chunk_encoder(tmp_path, lm, monkeypatch) -> None:
    from dataclasses import asdict

    from pc_rag.modules.serialize import module_span
    from pc_rag.scaleout.encoder_actor import ChunkEncoder
    from pc_rag.scaleout.encoder_spec import EncoderSpec

    monkeypatch.setenv("PC_RAG_CACHE", str(tmp_path / "cache"))
    lm.model.save_pretrained(tmp_path / "model")  # a worker loads the model by path, and its adapter from the cache
    lm.tokenizer.save_pretrained(tmp_path / "model")
    saved = model.load_model(str(tmp_path / "model"))
    adapter = encoding_adapter(saved)
    adapter.save(tmp_path / "cache" / "tuned" / adapter_file(saved.fingerprint()))
    store = make_store(tmp_path, RagEngine(saved, RagPrompt()), mode="fast", modules=str(tmp_path / "modules"))
    spec = EncoderSpec.of(store)
    assert spec.encoding["encoder"] == adapter.encoding_digest == store.manifest.identity.chunk_encoder
    record = store.manifest.chunks[0]
    batch = {"text": [record.text], "encode": [True], "content_hash": ["0" * 64], "chunk_id": [0],
             "token_ids": [store.engine.tokenize(module_text(record.text))]}  # fmt: skip
    ChunkEncoder(asdict(spec))(batch)
    key = store.kv.key("0" * 64)
    written = module_span(store.kv.modules.get_many([key])[0], key, dtype=torch.float32)
    torch.testing.assert_close(written.keys, all_chunks(store)[0].kv.keys)  # as the store encodes: by its encoder
    encoding_adapter(saved, 1).save(tmp_path / "cache" / "tuned" / adapter_file(saved.fingerprint()))  # another
    with pytest.raises(ChunkEncodingError, match="pc-rag store reencode"):  # a node with another adapter refuses
        ChunkEncoder(asdict(spec))(batch)


def test_the_http_server_answers_409_in_openais_error_shape(tmp_path, lm) -> None:
    from fastapi.testclient import TestClient

    from pc_rag.runtime.scheduler import Scheduler
    from pc_rag.server.http import create_app

    engine = RagEngine(lm, RagPrompt(), adapter=encoding_adapter(lm))
    store = make_store(tmp_path, engine, mode="prefix")
    scheduler = Scheduler(lm, max_batch=2)
    try:
        client = TestClient(create_app(PromptServer(store=store, scheduler=scheduler)))
        reply = client.post("/v1/rag", json={"question": QUESTION, "k": 2, "mode": "fast", "max_tokens": 2})
        assert reply.status_code == 409
        error = reply.json()["error"]
        assert error["code"] == "chunk_encoding_mismatch" and "pc-rag store reencode --store" in error["message"]
    finally:
        scheduler.close()
        store.close()


@pytest.fixture
def cli_corpus(tmp_path, monkeypatch, lm):
    """The CLI on the tiny model, whose splice adapter (with an encoding side) is installed where `pc-rag tune`
    puts it."""
    monkeypatch.setenv("PC_RAG_CACHE", str(tmp_path / "cache"))
    encoding_adapter(lm).save(tmp_path / "cache" / "tuned" / adapter_file(lm.fingerprint()))
    return cli_home(tmp_path, monkeypatch, lm)


def test_cli_store_reencode(cli_corpus, capsys) -> None:
    store = cli_corpus / "s"
    assert run(capsys, "index", cli_corpus / "docs", "--store", store, "--mode", "prefix")[0] == 0
    ask = ("ask", "--store", store, "-k", "1", "--max-new-tokens", "2", "--mode", "fast", "Who designed it?")
    code, _, err = run(capsys, *ask)
    assert code == 2 and f"pc-rag store reencode --store {store} --mode fast" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    code, _, err = run(capsys, "store", "verify", "--store", store, "--mode", "fast")
    assert code == 2 and "--mode goes with `store reencode`" in err
    code, _, err = run(capsys, "store", "reencode", "--store", store, "--mode", "no-such-mode")
    assert code == 2 and "no-such-mode" in err
    code, out, _ = run(capsys, "store", "reencode", "--store", store, "--mode", "fast")
    assert code == 0 and "re-encoded 2 chunks" in out and "for mode fast (conditioned, by splice adapter" in out
    assert Manifest.load(store / MANIFEST_NAME).identity.encoding_mode == "fast/conditioned"
    code, out, _ = run(capsys, *ask)
    assert code == 0 and "sources:" in out
    code, out, _ = run(capsys, "store", "reencode", "--store", store)  # the store's mode, now fast
    assert code == 0 and "for mode fast" in out
