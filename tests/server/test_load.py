"""A bounded load test on loopback: many concurrent streaming clients against a server with few decoding slots
and a short queue, some leaving mid-stream. Every request ends in a complete answer, a 429 with Retry-After, or a
clean disconnect; nothing answers 5xx; afterwards no row is left decoding."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from conftest import tiny_model
from live_server import live_server

from pc_rag.engine import PromptCache
from pc_rag.runtime.scheduler import Scheduler
from pc_rag.server.http import create_app
from pc_rag.server.prompt_server import PromptServer

CLIENTS, LEAVING = 32, 8


def leaves(i: int) -> bool:
    """Every fourth client leaves mid-stream, spread over the submission order: the first few clients are the
    ones admitted, and if all of them left no answer could complete (the test failed so in CI)."""
    return i % (CLIENTS // LEAVING) == 1


def test_concurrent_clients_get_answers_429s_or_leave_cleanly(tokenizer) -> None:
    lm = tiny_model("llama", tokenizer)
    scheduler = Scheduler(lm, max_batch=2, queue_limit=4)  # --max-concurrency 2
    server = PromptServer(prompt_cache=PromptCache(lm), scheduler=scheduler)
    with live_server(create_app(server)) as url:

        def client(i: int) -> str:
            body = {"messages": [{"role": "user", "content": f"Question {i}?"}], "max_tokens": 24, "stream": True}
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as reply:
                if reply.status_code == 429:
                    assert reply.headers["retry-after"] == "1"
                    return "busy"
                assert reply.status_code == 200, reply.read()
                events = 0
                for line in reply.iter_lines():
                    if line == "data: [DONE]":
                        return "done"
                    events += line.startswith("data: ")
                    if leaves(i) and events == 3:
                        return "left"  # closing the stream disconnects
                return "cut"

        with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
            outcomes = list(pool.map(client, range(CLIENTS)))
        deadline = time.monotonic() + 10
        while scheduler.active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.active == 0 and scheduler.waiting == 0
    scheduler.close()
    assert "cut" not in outcomes
    assert outcomes.count("done") >= 1 and set(outcomes) <= {"done", "busy", "left"}
