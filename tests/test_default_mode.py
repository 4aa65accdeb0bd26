"""The mode a new user gets: ``fast`` with a trained splice adapter, ``prefix`` (said once) without one; a store
keeps the mode it recorded."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from conftest import tiny_model
from test_document_store import DOCS, embedder

from pc_rag import model
from pc_rag.cli import main
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.adapter import AdapterConfig, SpliceAdapter
from pc_rag.rag.modes import ADAPTER_FREE_MODE, DEFAULT_MODE, resolve_mode
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store import document_store
from pc_rag.store.document_store import DocumentStore

NOTICE = "no trained splice adapter"


@pytest.fixture(scope="module")
def lm(tokenizer):
    return tiny_model("llama", tokenizer)


def notices(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if NOTICE in r.getMessage()]


def test_a_model_without_an_adapter_falls_back_to_prefix_with_one_notice(tmp_path, lm, caplog) -> None:
    engine = RagEngine(lm, RagPrompt())
    with caplog.at_level(logging.WARNING):
        assert engine.default_mode == ADAPTER_FREE_MODE == "prefix"
        chunks = engine.encode(["The Zorblax Tower was designed by Mirela Vantok."])
        engine.answer(chunks, "Who designed it?", max_new_tokens=2)  # no mode: the fallback, not an adapter error
        store = DocumentStore.create(tmp_path / "store", engine, embedder=embedder())
    assert store.mode == "prefix" and store.manifest.identity.encoding_mode == "prefix/conditioned"
    [line] = notices(caplog)
    assert repr(lm.name) in line and "'prefix' instead of 'fast'" in line and "pc-rag tune" in line
    store.close()


def test_a_model_with_an_adapter_gets_the_chosen_default(tmp_path, lm, caplog) -> None:
    torch.manual_seed(0)
    adapter = SpliceAdapter(lm.model, AdapterConfig(rank=2), lm.fingerprint()).requires_grad_(False)
    try:
        engine = RagEngine(lm, RagPrompt(), adapter=adapter)
        with caplog.at_level(logging.WARNING):
            store = DocumentStore.create(tmp_path / "store", engine, embedder=embedder())
        assert engine.default_mode == DEFAULT_MODE == "fast" and store.mode == "fast" and not notices(caplog)
        assert store.manifest.serving == {"adapter": adapter.digest}
        store.close()
    finally:
        adapter.detach()


def test_a_store_keeps_the_mode_it_recorded(tmp_path, lm) -> None:
    """A store made before issue 32 recorded ``default`` (selective:0.25): it still recomputes a quarter of its
    chunk tokens, though new stores get another mode."""
    engine = RagEngine(lm, RagPrompt())
    with DocumentStore.create(tmp_path / "store", engine, embedder=embedder(), mode="default") as store:
        store.add_documents(DOCS, progress=False)
    loaded = DocumentStore.load(tmp_path / "store", RagEngine(lm, RagPrompt()), embedder=embedder())
    assert loaded.mode == "default" and resolve_mode(loaded.mode).ratio == 0.25
    _, request, _ = PromptServer(store=loaded).rag_request("Which mountain is the highest of Japan?", k=2)
    assert request.refresh is not None  # recovery recomputes, as it did when the store was made
    loaded.close()


def test_the_cli_says_the_fallback_once(tmp_path, lm, monkeypatch, caplog) -> None:
    monkeypatch.setattr(model, "load_model", lambda *a, **k: lm)
    monkeypatch.setattr(document_store, "SentenceTransformerEmbedder", embedder)
    (tmp_path / "docs").mkdir()
    for i, (text, _) in enumerate(DOCS):
        (tmp_path / "docs" / f"{i}.txt").write_text(text)
    with caplog.at_level(logging.WARNING):
        assert main(["index", str(tmp_path / "docs"), "--store", str(tmp_path / "store")]) == 0
    assert len(notices(caplog)) == 1


def test_engines_on_one_model_share_its_merged_adapter(tmp_path, tokenizer, monkeypatch) -> None:
    """``fast`` is the default: a second engine (a LangChain LLM beside a server, a store built beside them) on
    the same model merges nothing twice, and a rewritten adapter file is refused rather than served by some
    engines and not others."""
    from pc_rag.rag.adapter import AdapterError
    from pc_rag.rag.tuned import adapter_file

    monkeypatch.setenv("PC_RAG_CACHE", str(tmp_path))
    lm = tiny_model("llama", tokenizer)
    torch.manual_seed(0)
    trained = SpliceAdapter(lm.model, AdapterConfig(rank=2), lm.fingerprint())
    path = tmp_path / "tuned" / adapter_file(lm.fingerprint())
    path.parent.mkdir()
    trained.save(path)
    first, second = RagEngine(lm, RagPrompt()), RagEngine(lm, RagPrompt())
    assert first.tuned.adapter() is second.tuned.adapter()
    chunks = first.encode(["The Zorblax Tower was designed by Mirela Vantok."])
    assert (
        first.answer(chunks, "Who?", max_new_tokens=3).token_ids
        == second.answer(chunks, "Who?", max_new_tokens=3).token_ids
    )
    trained.save(path)  # rewritten (a new pc-rag tune), a millisecond later whatever the clock's resolution
    stamp = path.stat().st_mtime_ns + 1_000_000
    os.utime(path, ns=(stamp, stamp))
    with pytest.raises(AdapterError, match="load the model again"):
        RagEngine(lm, RagPrompt()).tuned.adapter()
    first.tuned.adapter().detach()
