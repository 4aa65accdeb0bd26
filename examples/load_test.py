"""A bounded load test of ``pc-rag serve`` on loopback: concurrent RAG requests against serial ones.

    HF_HUB_OFFLINE=1 python examples/load_test.py --json examples/results/load_serve.json

Builds a store from the bundled HotpotQA sample's passages (or takes ``--store``), starts ``pc-rag serve`` on a
free loopback port as its own process, asks every sample question once, one at a time (the serial answers),
then sends ``--requests`` requests (the questions in turn) from ``--clients`` client threads at once to
``POST /v1/rag``. Reports how many failed or were lost, whether every answer equals the serial one, the p50
and p99 latency and the generated tokens per second, and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

CLI = [sys.executable, "-c", "from pc_rag.cli import main; raise SystemExit(main())"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=None, help="a store to serve (default: built from the sample)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("-k", type=int, default=3, help="chunks retrieved per question")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pc-rag-load-") as tmp:
        store = args.store or _sample_store(Path(tmp) / "store")
        questions = _questions()
        port = _free_port()
        server = subprocess.Popen([*CLI, "serve", "--store", str(store), "--port",
                                   str(port), "--max-batch", str(args.clients)])  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}/v1"
            _wait_ready(url, server)
            ask = _asker(url, args.k, args.max_tokens)
            serial = {q: ask(q)[0]["answer"] for q in questions}
            sent = [questions[i % len(questions)] for i in range(args.requests)]
            began = time.perf_counter()
            with ThreadPoolExecutor(max_workers=args.clients) as clients:
                replies = list(clients.map(_safely(ask), sent))
            wall = time.perf_counter() - began
        finally:
            server.terminate()
            server.wait(timeout=60)
    answered = [(q, r) for q, r in zip(sent, replies, strict=True) if r is not None]
    latencies = sorted(seconds for _, (_, seconds) in answered)
    tokens = sum(body["usage"]["completion_tokens"] for _, (body, _) in answered)
    result = {
        "requests": args.requests, "clients": args.clients, "failed": args.requests - len(answered),
        "identical": all(body["answer"] == serial[q] for q, (body, _) in answered),
        "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * _percentile(latencies, 0.99),
        "tokens_per_s": tokens / wall, "requests_per_s": len(answered) / wall, "wall_s": wall,
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def _sample_store(directory: Path) -> Path:
    """A store of the bundled sample's passages, built by ``pc-rag index`` from a JSONL of them."""
    from pc_rag.hotpotqa_sample import sample_questions

    docs = directory.parent / "passages.jsonl"
    unique = {f"{title}\n{text}" for q in sample_questions() for title, text in q.passages}
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in sorted(unique)))
    subprocess.run([*CLI, "index", str(docs), "--store", str(directory)], check=True)
    return directory


def _questions() -> list[str]:
    from pc_rag.hotpotqa_sample import sample_questions

    return [q.question for q in sample_questions()]


def _asker(url: str, k: int, max_tokens: int) -> Callable[[str], tuple[dict, float]]:
    def ask(question: str) -> tuple[dict, float]:
        began = time.perf_counter()
        reply = httpx.post(f"{url}/rag", json={"question": question, "k": k, "max_tokens": max_tokens}, timeout=600)
        reply.raise_for_status()
        return reply.json(), time.perf_counter() - began

    return ask


def _safely(ask: Callable[[str], tuple[dict, float]]) -> Callable[[str], tuple[dict, float] | None]:
    def call(question: str) -> tuple[dict, float] | None:
        try:
            return ask(question)
        except httpx.HTTPError as e:
            print(f"request failed: {e}", file=sys.stderr)
            return None

    return call


def _wait_ready(url: str, server: subprocess.Popen) -> None:
    for _ in range(600):
        if server.poll() is not None:
            raise SystemExit(f"pc-rag serve exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/models", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("pc-rag serve did not become ready in 5 minutes")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1)))]


if __name__ == "__main__":
    main()
