"""``pc-rag bench load``: the acceptance load test of the HTTP server, bounded in time, on loopback.

``clients`` streaming clients start at once against a server of few decoding slots (``--max-concurrency``),
spread over plain chat, ``+rag`` chat and ``/v1/completions``; ``leaving`` of them disconnect after two chunks.
Every request must end in a complete answer (``[DONE]`` after a finish reason), a 429 with ``Retry-After``, or its
planned disconnect; nothing may answer 5xx; afterwards the server's ``pc_rag:num_requests_running`` and
``..._waiting`` gauges (``/metrics``) must read 0. The server's resident memory is sampled from ``/proc`` all along.
``serve_sample`` builds a store from the bundled HotpotQA sample and starts ``pc-rag serve`` in a subprocess on a
free port; ``drive`` runs the clients against any URL. This module knows nothing about models or decoding.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from pc_rag.errors import PCRagError

OUTCOMES = ("done", "busy", "left", "5xx", "error", "timeout")  # the first three are the acceptable ends
KINDS = ("chat", "rag", "completion")
QUESTION = "Which city hosted the band's first performance? Answer briefly."


@dataclass(frozen=True)
class LoadPlan:
    clients: int = 64
    leaving: int = 16  # clients that disconnect after two chunks
    max_tokens: int = 32
    deadline_s: float = 600.0  # the whole run; a request still open then counts as "timeout"


@dataclass
class LoadResult:
    clients: int
    leaving: int
    max_tokens: int
    outcomes: dict[str, int]  # OUTCOMES -> requests
    by_kind: dict[str, dict[str, int]]  # KINDS -> outcome -> requests
    server_5xx: int
    running_after: float | None  # pc_rag:num_requests_running once the clients are done (None: not read)
    waiting_after: float | None
    max_rss_mb: float | None  # the server's peak resident memory while sampled (None: no /proc)
    rss_before_mb: float | None
    duration_s: float
    errors: list[str] = field(default_factory=list)  # the first few unacceptable ends, for the reader
    settings: dict[str, object] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        ends = self.outcomes
        return (
            ends.get("5xx", 0) == ends.get("error", 0) == ends.get("timeout", 0) == 0
            and ends.get("done", 0) >= 1
            and self.running_after == 0
            and self.waiting_after == 0
        )


def drive(url: str, plan: LoadPlan, server_pid: int | None = None) -> LoadResult:
    """Run ``plan``'s clients against the server at ``url`` (``http://host:port``), all at once; see the module
    docstring. ``server_pid``: the process whose RSS is sampled (default: this one, for a server in-process)."""
    import httpx

    models = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    plain = next(m for m in models if "+" not in m)
    rag = f"{plain}+rag" if f"{plain}+rag" in models else None
    leaving = set(range(plan.leaving))  # the kinds take turns, so these spread over them
    began = time.monotonic()
    deadline = began + plan.deadline_s
    start = threading.Barrier(plan.clients)

    def client(i: int) -> tuple[str, str, str]:
        kind = KINDS[i % len(KINDS)] if rag else ("chat", "completion")[i % 2]  # no store: no +rag model
        start.wait()
        try:
            return kind, *_request(url, kind, plain, rag, plan.max_tokens, i in leaving, deadline)
        except httpx.HTTPError as e:
            return kind, "error", f"client {i} ({kind}): {e!r}"

    with _RssSampler(server_pid or os.getpid()) as rss, ThreadPoolExecutor(max_workers=plan.clients) as pool:
        ends = list(pool.map(client, range(plan.clients)))
    running, waiting = _settled(url, timeout_s=30)
    by_kind: dict[str, Counter[str]] = {k: Counter() for k in KINDS}
    for kind, outcome, _ in ends:
        by_kind[kind][outcome] += 1
    counts = Counter(outcome for _, outcome, _ in ends)
    return LoadResult(
        plan.clients, len(leaving), plan.max_tokens, {o: counts.get(o, 0) for o in OUTCOMES},
        {k: dict(c) for k, c in by_kind.items() if c}, counts.get("5xx", 0), running, waiting,
        rss.max_mb, rss.first_mb, time.monotonic() - began, [why for _, o, why in ends if why][:10],
    )  # fmt: skip


def _request(
    url: str, kind: str, plain: str, rag: str | None, max_tokens: int, leaves: bool, deadline: float
) -> tuple[str, str]:
    """(outcome, why when unacceptable) of one streaming request."""
    import httpx

    body: dict[str, object] = {"max_tokens": max_tokens, "stream": True, "temperature": 0}
    if kind == "completion":
        route, body["model"], body["prompt"] = "/v1/completions", plain, f"Question: {QUESTION}\nAnswer:"
    else:
        route, body["model"] = "/v1/chat/completions", rag if kind == "rag" else plain
        body["messages"] = [{"role": "user", "content": QUESTION}]
    timeout = httpx.Timeout(max(1.0, deadline - time.monotonic()))
    with httpx.stream("POST", url + route, json=body, timeout=timeout) as reply:
        status = reply.status_code
        if status == 429:
            return ("busy", "") if reply.headers.get("retry-after") else ("error", "429 without Retry-After")
        if status >= 500:
            return "5xx", f"{route} {status}: {reply.read()[:300]!r}"
        if status != 200:
            return "error", f"{route} {status}: {reply.read()[:300]!r}"
        chunks, finished = 0, False
        for line in reply.iter_lines():
            if line == "data: [DONE]":
                return ("done", "") if finished else ("error", f"{route}: [DONE] without a finish reason")
            if line.startswith("data: "):
                chunks += 1
                choices = json.loads(line[6:]).get("choices") or [{}]
                finished = finished or choices[0].get("finish_reason") is not None
                if leaves and chunks == 2:
                    return "left", ""  # closing the stream disconnects
            if time.monotonic() > deadline:
                return "timeout", f"{route}: still streaming at the deadline after {chunks} chunks"
        return "error", f"{route}: the stream ended after {chunks} chunks without [DONE]"


def _settled(url: str, timeout_s: float) -> tuple[float | None, float | None]:
    """The running and waiting gauges once both read 0, or as they read at ``timeout_s``."""
    import httpx

    end = time.monotonic() + timeout_s
    running = waiting = None
    while True:
        try:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            running, waiting = _gauge(text, "num_requests_running"), _gauge(text, "num_requests_waiting")
        except httpx.HTTPError:
            pass
        if (running == 0 and waiting == 0) or time.monotonic() > end:
            return running, waiting
        time.sleep(0.1)


def _gauge(metrics: str, name: str) -> float | None:
    found = re.search(rf"^pc_rag:{name}\{{[^}}]*\}} (\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else None


class _RssSampler:
    """The peak resident memory (MB) of process ``pid``, read from ``/proc`` every ``interval_s`` in a thread."""

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.status, self.interval_s = Path(f"/proc/{pid}/status"), interval_s
        self.first_mb: float | None = None
        self.max_mb: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def __enter__(self) -> _RssSampler:
        self.first_mb = self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._read()
        self._read()

    def _read(self) -> float | None:
        try:
            text = self.status.read_text()
        except OSError:
            return None
        found = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
        if found is None:
            return None
        mb = int(found.group(1)) / 1024
        self.max_mb = max(self.max_mb or 0.0, mb)
        return mb


@contextmanager
def serve_sample(
    cli_args: Sequence[str], *, max_concurrency: int, queue_limit: int, documents: int, log: Path
) -> Iterator[tuple[str, int]]:
    """A store of the bundled HotpotQA sample's first ``documents`` passages, served by ``pc-rag serve`` in a
    subprocess on a free loopback port until the block ends: yields (its URL, its pid). ``cli_args``: the global
    options both commands get (``--model``, ``--dtype``, ``--threads``); their output goes to ``log``."""
    limits = ["--max-concurrency", str(max_concurrency), "--queue-limit", str(queue_limit)]
    log.write_text("")  # this run's output only
    with sample_store(cli_args, documents=documents, log=log) as store, serve_store(cli_args, store, limits, log) as up:
        yield up


@contextmanager
def sample_store(cli_args: Sequence[str], *, documents: int, log: Path) -> Iterator[Path]:
    """A temporary store of the bundled HotpotQA sample's first ``documents`` passages, indexed by ``pc-rag index``
    in a subprocess (its output goes to ``log``), until the block ends."""
    sample = files("pc_rag").joinpath("data/hotpotqa_sample.jsonl")
    with tempfile.TemporaryDirectory(prefix="pc-rag-load-") as tmp, log.open("a") as out:
        store = Path(tmp) / "store"
        index = [*_cli(cli_args), "index", "--store", str(store), "--limit", str(documents), str(sample)]
        if subprocess.run(index, stdout=out, stderr=subprocess.STDOUT, check=False).returncode:
            raise PCRagError(f"indexing the bundled sample failed: {' '.join(index)} (see {log})")
        yield store


@contextmanager
def serve_store(
    cli_args: Sequence[str], store: Path, serve_args: Sequence[str], log: Path
) -> Iterator[tuple[str, int]]:
    """``pc-rag serve --store store *serve_args`` in a subprocess on a free loopback port, once it answers
    ``/health``, until the block ends: yields (its URL, its pid). Its output is appended to ``log``."""
    port = _free_port()
    serve = [*_cli(cli_args), "serve", "--store", str(store), "--port", str(port), *serve_args]
    with log.open("a") as out:
        server = subprocess.Popen(serve, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server, timeout_s=600, log=log)
        yield url, server.pid
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _cli(cli_args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "pc_rag.cli", *cli_args]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, server: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    import httpx

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if server.poll() is not None:
            raise PCRagError(f"pc-rag serve exited with {server.returncode} before it answered (see {log})")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise PCRagError(f"pc-rag serve did not answer /health within {timeout_s:.0f} s (see {log})")


def format_result(result: LoadResult) -> str:
    """The outcome table and the invariants, one line each."""
    lines = [f"{'kind':<12}" + "".join(f"{o:>9}" for o in OUTCOMES)]
    for kind, counts in result.by_kind.items():
        lines.append(f"{kind:<12}" + "".join(f"{counts.get(o, 0):>9}" for o in OUTCOMES))
    lines.append(f"{'all':<12}" + "".join(f"{result.outcomes[o]:>9}" for o in OUTCOMES))
    rss = f"{result.max_rss_mb:.0f} MB (at start {result.rss_before_mb:.0f} MB)" if result.max_rss_mb else "n/a"
    lines += [
        f"clients {result.clients}, leaving after 2 chunks {result.leaving}, max_tokens {result.max_tokens}, "
        f"{result.duration_s:.1f} s",
        f"5xx {result.server_5xx}; running after {result.running_after}, waiting after {result.waiting_after}; "
        f"server max RSS {rss}",
        f"{'PASSED' if result.passed else 'FAILED'}: every request a complete answer, a 429 with Retry-After or a "
        "clean disconnect; no 5xx; no row left decoding",
        *result.errors,
    ]
    return "\n".join(lines)
