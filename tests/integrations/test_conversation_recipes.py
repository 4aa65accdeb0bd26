"""The conversation recipes of docs/frameworks.md run verbatim for three turns: every turn answers, module
references are spliced (never sent as text), and from turn 2 the history is read from the prefix cache."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import tiny_model
from test_document_store import make_store

from pc_rag.rag import RagEngine, RagPrompt

DOC = Path(__file__).parents[2] / "docs" / "frameworks.md"


def _recipe(marker: str) -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    (code,) = [b for b in blocks if marker in b]
    return code


@pytest.fixture(scope="module")
def store(tmp_path_factory, tokenizer):
    made = make_store(tmp_path_factory.mktemp("recipes"), RagEngine(tiny_model("llama", tokenizer), RagPrompt()))
    yield made
    made.close()


def test_the_langchain_history_recipe_reads_the_history_from_the_cache(store) -> None:
    pytest.importorskip("langchain_core")
    scope: dict[str, object] = {"store": store}
    exec(compile(_recipe("RunnableWithMessageHistory"), str(DOC), "exec"), scope)  # the docs, verbatim
    cache = scope["chat"].server.prefix_cache  # type: ignore[attr-defined]
    cache_read = scope["cache_read"]
    assert len(cache_read) == 3 and all(n > 0 for n in cache_read[1:])  # type: ignore[arg-type]
    assert cache.hits > 0  # turns 2 and 3 found the system turn and the history cached
    history = scope["sessions"]["demo"].messages  # type: ignore[index]
    assert len(history) == 6 and "pc-rag-module" not in str([m.content for m in history])


def test_the_llama_index_chat_engine_recipe_reads_the_history_from_the_cache(store, monkeypatch) -> None:
    pytest.importorskip("llama_index.core")
    from pc_rag.server.prompt_server import PromptServer

    calls: list[list[tuple[str, str]]] = []
    request_chat = PromptServer.request_chat

    def recorded(self, turns, system=None, **sampling):  # type: ignore[no-untyped-def]
        calls.append([("system", system or ""), *turns])
        return request_chat(self, turns, system, **sampling)

    monkeypatch.setattr(PromptServer, "request_chat", recorded)
    scope: dict[str, object] = {"store": store}
    exec(compile(_recipe("CondensePlusContextChatEngine"), str(DOC), "exec"), scope)  # the docs, verbatim
    cached = scope["cached_tokens"]
    assert len(cached) == 3 and all(n > 0 for n in cached[1:])  # type: ignore[arg-type]
    assert scope["llm"].server.prefix_cache.hits > 0  # type: ignore[attr-defined]
    answer = calls[-1]  # turn 3's answer: the history as chat turns, not flattened to "user: ..." text
    assert [role for role, _ in answer[1:]] == ["user", "assistant", "user", "assistant", "user"]
    assert not any(text.lstrip().startswith(("user:", "assistant:")) for _, text in answer)
