"""One timed answer and one benchmark row of ``bench peers --answers``, and how a row is measured.

Imports neither torch nor llama.cpp: the llama.cpp child process (``llama_cpp_answers``) measures its rows with
the same code as ours.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_TOKENS = 64


@dataclass
class Answer:
    """One answer: first-token ms, whole-answer ms, its token ids, and tokens per decode step."""

    first_ms: float
    total_ms: float
    token_ids: list[int]
    per_step: float | None


@dataclass
class AnswerRow:
    peer: str
    context_tokens: int
    question: str
    ttft_ms: float | None = None
    answer_ms: float | None = None
    tokens: int | None = None
    decode_tokens_per_s: float | None = None
    tokens_per_step: float | None = None
    same_as_plain: bool | None = None  # None for a peer's plain row itself
    busy: int = 0
    threads: int = 0
    note: str = ""
    token_ids: list[int] = field(default_factory=list, repr=False)


def measure(peer: str, run: Callable[[], Answer], context_tokens: int, question: str, runs: int) -> AnswerRow:
    """The median of ``runs`` answers after one warm-up (the outputs must not change between runs)."""
    run()
    answers = [run() for _ in range(runs)]
    ids = answers[0].token_ids
    if any(a.token_ids != ids for a in answers):
        return AnswerRow(peer, context_tokens, question, note="output changed between runs")
    total = statistics.median(a.total_ms for a in answers)
    first = statistics.median(a.first_ms for a in answers)
    decode_s = (total - first) / 1000
    speed = (len(ids) - 1) / decode_s if len(ids) > 1 and decode_s > 0 else None
    row = AnswerRow(peer, context_tokens, question, first, total, len(ids), speed, answers[0].per_step)
    row.token_ids = ids
    return row


def line(r: AnswerRow) -> str:
    """One row as the benchmark prints it while it runs."""
    if r.answer_ms is None:
        return f"{r.peer:<40} {r.context_tokens:>6} {r.question[:8]:<8}  {r.note}"
    speed = f"{r.decode_tokens_per_s:.1f}" if r.decode_tokens_per_s else "-"
    per_step = f"{r.tokens_per_step:.2f}" if r.tokens_per_step else "-"
    same = {None: "", True: "same", False: "DIFFERENT"}[r.same_as_plain]
    busy = f" busy={r.busy}" if r.busy else ""
    return (
        f"{r.peer:<40} {r.context_tokens:>6} {r.question[:8]:<8} TTFT {r.ttft_ms:7.0f} ms  answer {r.answer_ms:7.0f} ms"
        f"  {r.tokens:>3} tok  {speed:>6} tok/s  {per_step:>5}/step {same}{busy}"
    )
