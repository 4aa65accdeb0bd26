"""What a server in front of users needs: an API key, /health, /metrics, max_tokens clipped to the context, empty
questions refused, and a client that leaves mid-stream freeing its row."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from conftest import tiny_model
from live_server import live_server
from prometheus_client.parser import text_string_to_metric_families

from pc_rag.engine import PromptCache
from pc_rag.runtime.scheduler import Scheduler
from pc_rag.server.http import create_app
from pc_rag.server.prompt_server import PromptServer

KEY = "sk-test-key"
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def served(tokenizer) -> Iterator[tuple[str, Scheduler]]:
    lm = tiny_model("llama", tokenizer)
    scheduler = Scheduler(lm, max_batch=4)
    with live_server(create_app(PromptServer(prompt_cache=PromptCache(lm), scheduler=scheduler), api_key=KEY)) as url:
        yield url, scheduler
    scheduler.close()


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def _metrics(url: str) -> dict[str, float]:
    """Every sample of /metrics, parsed by prometheus_client, as ``name{labels}`` -> value."""
    text = httpx.get(f"{url}/metrics").text
    return {
        f"{s.name}{sorted(s.labels.items())}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _sample(samples: dict[str, float], name: str, **labels: str) -> float:
    key = f"{name}{sorted({'model_name': MODEL, **labels}.items())}"
    return samples.get(key, 0.0)


def test_the_api_key_is_asked_on_v1_not_on_health_or_metrics(served) -> None:
    url, _ = served
    with pytest.raises(openai.AuthenticationError) as refused:
        _client(url, key="wrong").models.list()
    assert refused.value.body["code"] == "invalid_api_key" and refused.value.status_code == 401
    no_key = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert no_key.status_code == 401 and set(no_key.json()["error"]) == {"message", "type", "param", "code"}
    assert [m.id for m in _client(url).models.list()] == [MODEL]
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}


def test_metrics_parse_and_count_requests_tokens_and_refusals(served) -> None:
    url, _ = served
    before = _metrics(url)
    reply = _client(url).completions.create(model=MODEL, prompt="The river", max_tokens=3)
    httpx.post(f"{url}/v1/models", headers={"authorization": "Bearer nope"})
    after = _metrics(url)
    generated = reply.usage.completion_tokens
    generated_total = "pc_rag:generation_tokens_total"
    assert _sample(after, generated_total) - _sample(before, generated_total) == generated
    assert _sample(after, "pc_rag:prompt_tokens_total") - _sample(before, "pc_rag:prompt_tokens_total") == (
        reply.usage.prompt_tokens
    )
    reason = reply.choices[0].finish_reason
    assert _sample(after, "pc_rag:request_success_total", finished_reason=reason) == (
        _sample(before, "pc_rag:request_success_total", finished_reason=reason) + 1
    )
    assert _sample(after, "pc_rag:request_rejected_total", status="401") >= 1
    assert _sample(after, "pc_rag:time_to_first_token_seconds_count") == (
        _sample(before, "pc_rag:time_to_first_token_seconds_count") + 1
    )
    for gauge in ("pc_rag:num_requests_running", "pc_rag:num_requests_waiting"):
        assert _sample(after, gauge) == 0
    assert _sample(after, "pc_rag:kv_cache_bytes", kind="arena") > 0
    assert "pc_rag:prefix_cache_hits_total" in str(after) and "pc_rag:inter_token_latency_seconds_bucket" in str(after)


def test_max_tokens_beyond_the_context_is_clipped_with_finish_reason_length(served, tokenizer) -> None:
    url, scheduler = served
    room = 3
    words = (scheduler.lm.max_positions - room) * 100 // len(tokenizer("word " * 100)["input_ids"])
    while len(tokenizer("word " * (words + 1))["input_ids"]) <= scheduler.lm.max_positions - room:
        words += 1  # the longest prompt that leaves at most ``room`` positions
    prompt = "word " * words
    reply = _client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=1000, stop=None)
    left = scheduler.lm.max_positions - reply.usage.prompt_tokens
    assert 1 <= left <= room
    assert reply.usage.completion_tokens <= left
    if reply.usage.completion_tokens == left:  # no end-of-sequence token came first
        assert reply.choices[0].finish_reason == "length"


@pytest.mark.parametrize("content", ["", "   \n\t"])
def test_an_empty_user_message_is_refused(served, content: str) -> None:
    url, _ = served
    with pytest.raises(openai.BadRequestError, match="user message is empty") as refused:
        _client(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
    assert refused.value.body["param"] == "messages"


def test_a_client_that_leaves_mid_stream_frees_its_row(served) -> None:
    url, scheduler = served
    before = _metrics(url)
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}) as r:
        chunks: list[str] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line)
            if len(chunks) == 2:
                break
        assert scheduler.active == 1  # 4000 tokens take far longer than this
    deadline = time.monotonic() + 5  # without cancellation the row decodes its 4000 tokens (tens of seconds)
    while scheduler.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.active == 0 and scheduler.arena.active == 0
    after = _metrics(url)
    aborted = _sample(after, "pc_rag:request_success_total", finished_reason="abort")
    assert aborted == _sample(before, "pc_rag:request_success_total", finished_reason="abort") + 1
