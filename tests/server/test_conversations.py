"""Conversations over the store: ``+rag`` answers any OpenAI message list (system turns anywhere, names), from the
chunks retrieved for its last turn made standalone, with the history's KV reused from the previous turn; the plain
model reuses it too. Reuse changes no answer."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from conftest import tiny_model
from live_server import live_server
from test_document_store import make_store

from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.condense import refers_back, standalone_query
from pc_rag.runtime.prefix_cache import PrefixCache
from pc_rag.runtime.scheduler import Scheduler
from pc_rag.server.http import create_app
from pc_rag.server.prompt_server import PromptServer

RAG = "tiny-llama+rag"
SYSTEM = {"role": "system", "content": "You answer from the documents."}
QUESTIONS = ["Where does the Danube end?", "How long is it?", "Which city has the tower?"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer) -> Iterator[tuple[openai.OpenAI, PromptServer, PromptServer]]:
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    store = make_store(tmp_path_factory.mktemp("conversations"), engine)
    scheduler = Scheduler(engine.lm, max_batch=4)
    server = PromptServer(store=store, scheduler=scheduler, prefix_cache=PrefixCache())
    with live_server(create_app(server)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield client, server, PromptServer(store=store)  # the last: no scheduler, no prefix cache
    scheduler.close()


def _converse(client: openai.OpenAI, model: str) -> list[openai.types.chat.ChatCompletion]:
    messages: list[dict[str, str]] = [SYSTEM]
    replies = []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question, "name": "ana"})
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6)  # type: ignore[arg-type]
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        replies.append(reply)
    return replies


def _alone(reference: PromptServer, replies: list[openai.types.chat.ChatCompletion]) -> list[str]:
    """The same conversation answered by a server with no prefix cache."""
    turns: list[tuple[str, str]] = []
    texts = []
    for question, reply in zip(QUESTIONS, replies, strict=True):
        turns.append(("user", question))
        answer = reference.answer_chat(list(turns), SYSTEM["content"], 5, max_new_tokens=6)
        texts.append(answer.text)
        turns.append(("assistant", reply.choices[0].message.content or ""))
    return texts


def test_a_rag_conversation_answers_each_turn_with_sources_and_reuses_its_history(served) -> None:
    client, server, reference = served
    assert server.prefix_cache is not None
    hits = server.prefix_cache.hits
    replies = _converse(client, RAG)
    assert all(r.model_extra and r.model_extra["sources"] for r in replies)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]  # type: ignore[union-attr]
    assert server.prefix_cache.hits > hits  # turns 2 and 3 read the history from the cache
    assert cached[1] > cached[0] - 10 and cached[2] > cached[1]  # the history grows; it is cached, not computed
    assert [r.choices[0].message.content for r in replies] == _alone(reference, replies)


def test_plain_chat_reuses_the_history(served) -> None:
    client, _, _ = served
    replies = _converse(client, "tiny-llama")
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]  # type: ignore[union-attr]
    assert cached[0] >= 0 and cached[1] > 0 and cached[2] > cached[1]


def test_system_turns_anywhere_are_accepted(served) -> None:
    client, _, _ = served
    messages = [
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": "The Black Sea."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    for model in (RAG, "tiny-llama"):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=3)  # type: ignore[arg-type]
        assert reply.choices[0].finish_reason in ("stop", "length")


def test_a_follow_up_is_searched_with_the_turn_it_refers_to() -> None:
    turns = [("user", "Who was George Atzerodt?"), ("assistant", "A conspirator."), ("user", "When was he born?")]
    assert standalone_query(turns) == "Who was George Atzerodt? A conspirator. When was he born?"
    assert standalone_query(turns, condense=False) == "When was he born?"
    assert not refers_back("Where was Andrew Johnson born and raised?")
    standalone = [*turns[:2], ("user", "Where was Andrew Johnson born and raised?")]
    assert standalone_query(standalone) == standalone[-1][1]


def test_the_conversation_bench_client_answers_every_turn_with_sources_and_cached_tokens(served) -> None:
    """``pc-rag bench conversation``'s client (``converse``) against a live server: each turn streams tokens and
    lists its sources; given the first run's replies as history, a second run answers the same."""
    from pc_rag.bench.conversation import converse

    client, _, _ = served
    url = str(client.base_url).rstrip("/").removesuffix("/v1")
    first = converse(url, QUESTIONS, new_tokens=4, k=2)
    assert [t.sources for t in first] == [2, 2, 2]
    assert all(t.ttft_ms > 0 and t.text and t.cached_tokens > 0 for t in first)
    again = converse(url, QUESTIONS, [t.text.strip() or "I do not know." for t in first], new_tokens=4, k=2)
    assert [t.text for t in again] == [t.text for t in first]
    assert [t.prompt_tokens for t in again] == [t.prompt_tokens for t in first]
