"""``pc-rag ask --full`` compares warm paths: an untimed 1-token answer of each runs before either is timed."""

from __future__ import annotations

import pytest
from conftest import tiny_model
from test_document_store import DOCS, embedder

from pc_rag.cli import store_commands
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore


@pytest.fixture(scope="module")
def lm(tokenizer):
    return tiny_model("llama", tokenizer)


def test_ask_warms_both_paths_before_timing_either(tmp_path, lm, monkeypatch) -> None:
    """``ask --full`` once timed the cached answer in a cold process and full prefill after it, warm."""
    engine = RagEngine(lm, RagPrompt.longbench())
    with DocumentStore.create(tmp_path / "store", engine, embedder=embedder()) as store:
        store.add_documents(DOCS, progress=False)
    calls: list[tuple[str, int]] = []

    class Spy(PromptServer):
        def answer(self, question, k=5, mode=None, **sampling):
            calls.append(("cached", sampling["max_new_tokens"]))
            return super().answer(question, k, mode, **sampling)

        def answer_full(self, question, k=5, **sampling):
            calls.append(("full", sampling["max_new_tokens"]))
            return super().answer_full(question, k, **sampling)

    monkeypatch.setattr(store_commands, "PromptServer", Spy)
    load = DocumentStore.load
    monkeypatch.setattr(store_commands.DocumentStore, "load", lambda d, e, **kw: load(d, e, embedder=embedder(), **kw))
    store_commands.ask(lm, tmp_path / "store", "Which river flows into the Black Sea?", k=2, mode=None,
                       compare_full=True, max_new_tokens=4)  # fmt: skip
    assert calls == [("cached", 1), ("full", 1), ("cached", 4), ("full", 4)]
