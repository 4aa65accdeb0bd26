"""``pc-rag bench conversation``: a 10-turn ``+rag`` conversation with a system message, through the ``openai``
client against ``pc-rag serve`` in a subprocess, with the server's history cache on and off.

The store holds the bundled HotpotQA sample's passages; turn ``i`` asks the sample's question ``i`` after the whole
history. The server without the cache (``--prefix-cache-mb 0``) goes first; its replies become the assistant turns of
both runs, so both serve the same prompts. TTFT is the client's: from sending the request to the first streamed
token. Each turn must answer and list its sources (the stream's first chunk carries ``sources``). This module
loads no model.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pc_rag.bench.load import sample_store, serve_store
from pc_rag.errors import PCRagError
from pc_rag.hotpotqa_sample import sample_questions

if TYPE_CHECKING:
    from openai import OpenAI

SYSTEM = "You are a helpful assistant. Answer briefly from the documents."
RUNS = (("no_cache", ["--prefix-cache-mb", "0"]), ("cache", []))  # no cache first: its replies are the history


@dataclass(frozen=True)
class Turn:
    """One streamed reply, as the client saw it."""

    ttft_ms: float
    text: str
    sources: int  # chunks listed in the stream's first chunk
    prompt_tokens: int
    cached_tokens: int


@dataclass
class ConversationRun:
    """Both runs, turn by turn; ``passed`` when every turn answered with sources and turn ``turns``' TTFT with the
    cache is within ``limit`` of turn 1's."""

    turns: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    limit: float = 1.5

    def ratio(self, label: str) -> float:
        return float(self.rows[-1][f"{label}_ttft_ms"] / self.rows[0][f"{label}_ttft_ms"])

    @property
    def answered(self) -> bool:
        return all(r[f"{label}_sources"] > 0 and r[f"{label}_chars"] > 0 for r in self.rows for label, _ in RUNS)

    @property
    def passed(self) -> bool:
        return self.answered and self.ratio("cache") <= self.limit


def run_http_conversation(
    cli_args: Sequence[str], *, turns: int = 10, new_tokens: int = 16, k: int = 3, log: Path
) -> ConversationRun:
    """Index the sample's passages for ``turns`` questions, then hold the conversation against a server without
    and a server with the history cache (one after the other, never together)."""
    questions = sample_questions()
    if not 1 <= turns <= len(questions):
        msg = f"--turns must be between 1 and {len(questions)} (the bundled sample's questions), got {turns}"
        raise PCRagError(msg)
    asked = [q.question for q in questions[:turns]]
    run = ConversationRun(turns, [{"turn": i + 1} for i in range(turns)])
    replies: list[str] | None = None
    log.write_text("")
    with sample_store(cli_args, documents=sum(len(q.passages) for q in questions[:turns]), log=log) as store:
        for label, serve_args in RUNS:
            with serve_store(cli_args, store, serve_args, log) as (url, _):
                said = converse(url, asked, replies, new_tokens=new_tokens, k=k)
            replies = replies or [t.text.strip() or "I do not know." for t in said]
            for row, turn in zip(run.rows, said, strict=True):
                row |= {
                    "prompt_tokens": turn.prompt_tokens, f"{label}_ttft_ms": turn.ttft_ms,
                    f"{label}_cached": turn.cached_tokens, f"{label}_sources": turn.sources,
                    f"{label}_chars": len(turn.text.strip()), f"{label}_reply": turn.text,
                }  # fmt: skip
    return run


def converse(
    url: str, questions: Sequence[str], replies: Sequence[str] | None = None, *, new_tokens: int = 16, k: int = 3
) -> list[Turn]:
    """Ask ``questions`` in turn of the ``+rag`` model at ``url`` under ``SYSTEM``, each after the whole history;
    the assistant turns are the replies given, or (``replies`` None) the server's own."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = next(m.id for m in client.models.list().data if m.id.endswith("+rag"))
    history: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    said = []
    for i, question in enumerate(questions):
        history.append({"role": "user", "content": question})
        said.append(_ask(client, model, history, new_tokens, k))
        reply = replies[i] if replies is not None else said[-1].text.strip() or "I do not know."
        history.append({"role": "assistant", "content": reply})
    return said


def _ask(client: OpenAI, model: str, messages: list[dict[str, str]], new_tokens: int, k: int) -> Turn:
    """One streamed ``+rag`` turn through the ``openai`` client."""
    began = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=new_tokens, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_body={"k": k},
    )  # fmt: skip
    ttft_ms, text, sources, usage = None, [], 0, None
    for chunk in stream:
        extra = chunk.model_extra or {}
        sources = max(sources, len(extra.get("sources") or []))
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                ttft_ms = ttft_ms if ttft_ms is not None else (time.perf_counter() - began) * 1000
                text.append(choice.delta.content)
    if ttft_ms is None or usage is None:
        msg = f"{client.base_url}: a +rag turn streamed no token or no usage (turn of {len(messages)} messages)"
        raise PCRagError(msg)
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None and details.cached_tokens is not None else 0
    return Turn(ttft_ms, "".join(text), sources, usage.prompt_tokens, cached)


def format_conversation_run(run: ConversationRun) -> str:
    head = f"{'turn':>4} {'prompt':>7} {'no cache ms':>12} {'cache ms':>9} {'cached tok (no/yes)':>20}"
    lines = [f"{head} {'sources':>8}"]
    for r in run.rows:
        lines.append(
            f"{r['turn']:>4} {r['prompt_tokens']:>7} {r['no_cache_ttft_ms']:>12.0f} {r['cache_ttft_ms']:>9.0f} "
            f"{r['no_cache_cached']:>9}/{r['cache_cached']:<10} {r['cache_sources']:>8}"
        )
    lines.append(
        f"turn {run.turns} / turn 1 TTFT: {run.ratio('cache'):.2f}x with the history cache, "
        f"{run.ratio('no_cache'):.2f}x without; every turn answered with sources: {run.answered}"
    )
    lines.append(f"{'PASSED' if run.passed else 'FAILED'}: turn {run.turns} within {run.limit}x of turn 1, cached")
    return "\n".join(lines)
