"""What the real ``openai`` client sends is answered in OpenAI's terms: bad requests as 400s naming the field,
model ids that retrieve from the store (or do not), and completions that continue the raw text."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import openai
import pytest
from conftest import tiny_model
from fastapi.testclient import TestClient
from test_document_store import make_store

from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.runtime.scheduler import Scheduler
from pc_rag.server.http import create_app
from pc_rag.server.prompt_server import PromptServer

PLAIN, RAG = "tiny-llama", "tiny-llama+rag"
QUESTION = "Where does the Danube end?"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer) -> Iterator[tuple[openai.OpenAI, TestClient, PromptServer]]:
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    store = make_store(tmp_path_factory.mktemp("openai"), engine)
    scheduler = Scheduler(engine.lm, max_batch=4)
    http = TestClient(create_app(PromptServer(store=store, scheduler=scheduler)))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", max_retries=0, http_client=http)
    yield client, http, PromptServer(store=store)  # the last one serves alone, for reference
    scheduler.close()
    store.close()


BAD_REQUESTS: dict[str, tuple[Callable[[openai.OpenAI], object], str]] = {
    "max_tokens 0": (lambda c: c.chat.completions.create(model=PLAIN, messages=HI, max_tokens=0), "max_tokens"),
    "max_tokens -1": (lambda c: c.completions.create(model=PLAIN, prompt="hi", max_tokens=-1), "max_tokens"),
    "temperature -1": (lambda c: c.chat.completions.create(model=PLAIN, messages=HI, temperature=-1), "temperature"),
    "empty messages": (lambda c: c.chat.completions.create(model=PLAIN, messages=[]), "messages"),
    "no prompt": (lambda c: c.post("/completions", body={"model": PLAIN}, cast_to=object), "prompt"),
    "n 2": (lambda c: c.chat.completions.create(model=PLAIN, messages=HI, n=2), "n"),
    "empty question": (lambda c: c.post("/rag", body={"question": ""}, cast_to=object), "question"),
    "unknown mode": (lambda c: c.post("/rag", body={"question": QUESTION, "mode": "nope"}, cast_to=object), "mode"),
    "logprobs": (lambda c: c.chat.completions.create(model=PLAIN, messages=HI, logprobs=True), "logprobs"),
    "image part": (
        lambda c: c.chat.completions.create(
            model=PLAIN, messages=[{"role": "user", "content": [{"type": "image_url"}]}]
        ),
        "messages[0].content",
    ),
    "k 0": (lambda c: c.post("/rag", body={"question": QUESTION, "k": 0}, cast_to=object), "k"),
    "rag k 0": (lambda c: c.chat.completions.create(model=RAG, messages=HI, extra_body={"k": 0}), "k"),
    "k without rag": (lambda c: c.chat.completions.create(model=PLAIN, messages=HI, extra_body={"k": 2}), "k"),
    "empty turn for rag": (
        lambda c: c.chat.completions.create(
            model=RAG, messages=[*HI, {"role": "assistant", "content": "x"}, {"role": "user", "content": " "}]
        ),
        "messages",
    ),
    "rag model completing": (lambda c: c.completions.create(model=RAG, prompt="hi"), "model"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_a_bad_request_is_a_400_in_openai_shape_naming_the_field(served, case: str) -> None:
    send, field = BAD_REQUESTS[case]
    with pytest.raises(openai.BadRequestError, match=re.escape(field)) as caught:
        send(served[0])
    error = caught.value
    assert error.status_code == 400 and error.param == field and error.type == "invalid_request_error"


def test_invalid_json_unknown_routes_and_models_answer_in_openai_shape(served) -> None:
    client, http, _ = served
    reply = http.post("/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="/v1/embeddings"):
        client.embeddings.create(model=PLAIN, input="x")
    for model in ("gpt-4", f"{RAG}:nope"):
        with pytest.raises(openai.NotFoundError, match=re.escape(model)) as caught:
            client.chat.completions.create(model=model, messages=HI)
        assert caught.value.code == "model_not_found" and caught.value.param == "model"


def test_models_list_the_plain_and_the_rag_ids(served) -> None:
    ids = [m.id for m in served[0].models.list()]
    assert ids[:2] == [PLAIN, RAG] and f"{RAG}:prefix" in ids


def test_the_rag_model_answers_from_the_store_as_the_rag_route_does(served) -> None:
    client, _, alone = served
    ask = [{"role": "user", "content": QUESTION}]
    for model, extra in ((RAG, {"k": 2}), (RAG, {}), (f"{RAG}:prefix", {"k": 2})):
        reply = client.chat.completions.create(model=model, messages=ask, max_tokens=6, extra_body=extra)
        mode = model.partition("+rag:")[2] or None
        rag = client.post("/rag", body={"question": QUESTION, "max_tokens": 6, "mode": mode, **extra}, cast_to=object)
        assert reply.choices[0].message.content == rag["answer"] and reply.model == model
        assert reply.sources == rag["sources"] and len(reply.sources) == min(extra.get("k", 5), len(alone.store))
        assert reply.usage.completion_tokens == rag["usage"]["completion_tokens"]
    whole = client.chat.completions.create(model=RAG, messages=ask, max_tokens=6)
    chunks = list(client.chat.completions.create(model=RAG, messages=ask, max_tokens=6, stream=True))
    assert chunks[0].sources == whole.sources  # the first chunk carries the sources
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_the_plain_model_does_not_retrieve(served) -> None:
    client, _, alone = served
    ask = [{"role": "user", "content": QUESTION}]  # with fields that change nothing, as clients send them
    reply = client.chat.completions.create(
        model=PLAIN, messages=ask, max_tokens=6, user="u", n=1, stream_options=None, extra_body={"metadata": {}}
    )
    expected = alone.stream_chat([("user", QUESTION)], max_new_tokens=6)
    assert reply.choices[0].message.content == "".join(expected) and not hasattr(reply, "sources")
    assert reply.usage.prompt_tokens == expected.result.stats.computed_tokens  # the question alone, no chunks


def test_a_completion_continues_the_raw_text(served, tokenizer) -> None:
    client, _, alone = served
    prompt = "The Danube flows into the"
    reply = client.completions.create(model=PLAIN, prompt=prompt, max_tokens=6)
    ids = tokenizer(prompt)["input_ids"]  # the tokenizer's own encoding: no chat template around it
    assert reply.choices[0].text == "".join(alone.engine.stream_ids(ids, max_new_tokens=6))
    assert reply.usage.prompt_tokens == len(ids)
    ref = alone.store.module_ref(alone.store.search(QUESTION, k=1)[0])
    with pytest.raises(openai.BadRequestError, match="chat"):  # module references are a chat turn's
        client.completions.create(model=PLAIN, prompt=ref + QUESTION, max_tokens=2)
