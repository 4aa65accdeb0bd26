"""The OpenAI-compatible server answers the real ``openai`` client as the engine answers alone, streams, counts
usage, and refuses what it cannot do with the right status."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from conftest import tiny_model
from live_server import live_server
from test_document_store import make_store

from pc_rag.engine import PromptCache
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.runtime.scheduler import Scheduler
from pc_rag.server.http import create_app
from pc_rag.server.prompt_server import PromptServer

QUESTION = "Where does the Danube end?"
MODEL = "tiny-llama"  # the plain model id: no retrieval by the server


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer) -> Iterator[tuple[str, PromptServer]]:
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    store = make_store(tmp_path_factory.mktemp("http"), engine)
    scheduler = Scheduler(engine.lm, max_batch=8)
    prompt_server = PromptServer(store=store, scheduler=scheduler)
    with live_server(create_app(prompt_server)) as url:
        yield f"{url}/v1", PromptServer(store=store)  # the second serves alone, for reference
    scheduler.close()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0)


def test_chat_completion_equals_the_engine_alone_and_counts_usage(served) -> None:
    url, alone = served
    reply = _client(url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=8
    )
    expected = alone.stream_chat([("user", QUESTION)], max_new_tokens=8)
    text = "".join(expected)
    assert reply.choices[0].message.content == text and reply.choices[0].message.role == "assistant"
    stats = expected.result.stats
    assert reply.usage.completion_tokens == stats.new_tokens
    assert reply.usage.prompt_tokens == stats.cached_tokens + stats.computed_tokens
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_streamed_chat_is_the_same_text_in_pieces_with_usage_last(served) -> None:
    url, _ = served
    client = _client(url)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens and not chunks[-1].choices


def test_chat_serves_module_references_and_concurrent_clients_get_serial_answers(served) -> None:
    url, alone = served
    store = alone.store
    prompts = [
        "".join(store.module_ref(h) for h in store.search(q, k=2)) + q
        for q in (QUESTION, "Which city has the tower?", "Is Fuji a volcano?", "How tall is the tower?")
    ]
    serial = ["".join(alone.stream(p, max_new_tokens=6)) for p in prompts]
    client = _client(url)

    def ask(prompt: str) -> str | None:
        messages = [{"role": "user", "content": prompt}]
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6).choices[0].message.content

    with ThreadPoolExecutor(max_workers=16) as pool:
        texts = list(pool.map(ask, prompts * 16))
    assert texts == serial * 16  # 64 requests from 16 client threads: none lost, each as served alone


def test_the_rag_route_answers_with_sources_and_timings(served) -> None:
    url, alone = served
    body = httpx.post(f"{url}/rag", json={"question": QUESTION, "k": 2, "max_tokens": 6}, timeout=60).json()
    expected = PromptServer(store=alone.store).answer(QUESTION, k=2, max_new_tokens=6)
    assert body["answer"] == expected.text
    assert [s["chunk_id"] for s in body["sources"]] == [h.chunk_id for h in expected.sources]
    assert body["timings"]["ttft_ms"] > 0 and body["usage"]["completion_tokens"] == expected.result.stats.new_tokens


def test_what_the_server_cannot_do_is_refused_with_the_right_status(served) -> None:
    url, _ = served
    client = _client(url)
    with pytest.raises(openai.BadRequestError, match="one choice"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    with pytest.raises(openai.BadRequestError, match="end with a user message"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "assistant", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match=r"reaches position"):
        client.completions.create(model=MODEL, prompt="word " * 5000, max_tokens=4)
    assert httpx.post(f"{url}/rag", json={"question": ""}).status_code == 400


def test_a_full_queue_answers_429(tokenizer, monkeypatch) -> None:
    from fastapi.testclient import TestClient

    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    scheduler = Scheduler(engine.lm, queue_limit=1)
    monkeypatch.setattr(scheduler, "_run", lambda: None)  # a worker that never serves: requests wait
    monkeypatch.setattr(scheduler, "call", lambda fn: fn())
    client = TestClient(create_app(PromptServer(prompt_cache=PromptCache(engine.lm), scheduler=scheduler)))
    scheduler._waiting.append(object())  # one request already waits
    reply = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
    assert "queue limit 1" in reply.json()["error"]["message"]


def test_langchain_chat_openai_pointed_at_the_server_gets_the_same_answers(served) -> None:
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    url, alone = served
    chat = ChatOpenAI(base_url=url, api_key="unused", model=MODEL, max_tokens=8, temperature=0, max_retries=0)
    expected = "".join(alone.stream_chat([("user", QUESTION)], max_new_tokens=8))
    assert chat.invoke([HumanMessage(QUESTION)]).content == expected
    assert "".join(chunk.content for chunk in chat.stream([HumanMessage(QUESTION)])) == expected
    assert [m.content for m in chat.batch([[HumanMessage(QUESTION)]] * 4)] == [expected] * 4


def test_a_module_store_that_lost_its_modules_answers_503(tmp_path, tokenizer) -> None:
    from fastapi.testclient import TestClient

    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    store = make_store(tmp_path, engine, modules=str(tmp_path / "modules"))
    for module in (tmp_path / "modules").rglob("*.pcrm"):
        module.unlink()  # as a Redis restarted empty would have them
    scheduler = Scheduler(engine.lm, max_batch=2)
    try:
        client = TestClient(create_app(PromptServer(store=store, scheduler=scheduler)))
        reply = client.post("/v1/rag", json={"question": QUESTION, "k": 2, "max_tokens": 2})
        assert reply.status_code == 503 and reply.headers["retry-after"] == "1"
        assert "missing from the module store" in reply.json()["error"]["message"]
    finally:
        scheduler.close()
        store.close()
