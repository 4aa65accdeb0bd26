"""Seconds per streamed token after the first, for the plain model and ``+rag`` on one running ``pc-rag serve``
(issue 38, item 4: on a busy machine the plain model decoded 10x slower than ``+rag`` on the same server).

    python examples/plain_vs_rag_decode.py http://127.0.0.1:8000 30

Run it with and without a busy loop beside the server (``python -c 'while True: pass' &``); the server started with
``pc-rag --threads auto serve ...``. This script knows nothing about pc-rag's code: it speaks HTTP.
"""

from __future__ import annotations

import sys
import time

import httpx

QUESTION = "Who founded the band that released Tinted Windows? Tell me about them."


def seconds_per_token(url: str, model: str, tokens: int) -> tuple[int, float]:
    """(content chunks streamed, mean seconds between them after the first)."""
    body = {"model": model, "stream": True, "max_tokens": tokens, "temperature": 0,
            "messages": [{"role": "user", "content": QUESTION}]}  # fmt: skip
    times = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=900) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                times.append(time.perf_counter())
    return len(times), (times[-1] - times[0]) / max(1, len(times) - 1) if times else float("nan")


def main(url: str, tokens: int) -> None:
    models = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    plain = next(m for m in models if "+" not in m)
    for model in (plain, f"{plain}+rag"):
        chunks, gap = seconds_per_token(url, model, tokens)
        print(f"{model}: {chunks} tokens streamed, {gap:.3f} s/token after the first")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
