"""``pc-rag bench peers --answers``: the time to a whole answer, ours against llama.cpp on the same GGUF.

A user waits for the answer, not its first token. Each workload is a real question of the bundled sample with
its own passages, padded with other sample passages to about ``target`` tokens, in the ``ask`` prompt. Every peer
answers it greedily, up to 64 tokens, stopping at EOS; a row is one (peer, length, question), timed as the median
of ``runs`` answers after a warm-up, with its TTFT, decode tokens/s, tokens generated, tokens per decode step and
whether its output equals the same peer's plain decoding. Our rows: the default mode and ``naive``, each with
speculation and without. llama.cpp (``llama-cpp-python``, same threads, in a process of its own after ours:
``llama_cpp_answers``): full prefill, its prefix cache warm and prompt-lookup decoding on the warm prefix. ``busy``
loops (plain Python processes spinning) can run beside the timing. This module knows nothing about how serving
works; it times engines and libraries.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pc_rag.bench.answer_rows import MAX_TOKENS, Answer, AnswerRow, line, measure
from pc_rag.bench.llama_cpp_answers import LLAMA_CPP_ROWS, llama_cpp_rows, unavailable
from pc_rag.bench.peers import QUESTION, passage_budget
from pc_rag.hotpotqa_sample import SampleQuestion, sample_questions
from pc_rag.rag.engine import Chunk, RagEngine
from pc_rag.runtime.model_runner import ModelRunner
from pc_rag.runtime.threads import free_cores_used, use_free_cores

AUTO = " (--threads auto)"
__all__ = ["LLAMA_CPP_ROWS", "AnswerRow", "answer_workload", "gates", "markdown", "run_answers", "summary"]


@dataclass(frozen=True)
class AnswerWorkload:
    question: SampleQuestion
    chunks: list[Chunk]
    ids: list[int]  # the whole prompt, for peers that take tokens
    documents: int  # tokens up to the question: what a prefix cache holds across questions


def answer_workload(engine: RagEngine, question: SampleQuestion, target: int) -> AnswerWorkload:
    """``question``'s passages first, then other sample passages, until the prompt holds about ``target``
    tokens (the last passage cut), and never so many that the answer would run past the model's positions."""
    positions = engine.lm.model.config.get_text_config().max_position_embeddings
    tail = {q: len(engine.tokenize(engine.prompt.tail(engine.wrappers, q))) for q in (question.question, QUESTION)}
    longer_question = max(0, tail[question.question] - tail[QUESTION])  # than the one passage_budget counts
    longest = positions - MAX_TOKENS - longer_question - 16  # 16: passages cut, decoded and tokenized again
    budget = passage_budget(engine, min(target, longest))
    others = [p for q in sample_questions() if q.id != question.id for p in q.passages]
    texts: list[str] = []
    for title, body in [*question.passages, *others]:
        ids = engine.tokenize(engine.passage_text(len(texts) + 1, title, body))[:budget]
        if len(ids) < 8:
            break
        texts.append(engine.lm.tokenizer.decode(ids))
        budget -= len(ids)
    chunks = engine.encode(texts)
    ids = engine.full_ids(chunks, question.question)
    documents = len(engine.head_ids) + sum(len(c.token_ids) for c in chunks)
    return AnswerWorkload(question, chunks, ids, documents)


Peer = Callable[[AnswerWorkload], Answer]


def engine_peers(engine: RagEngine) -> dict[str, tuple[Peer, str | None]]:
    """Our rows: (run, the name of the row whose output it must equal, or None)."""

    def answer(mode: str, speculative: bool | None) -> Peer:
        def run(work: AnswerWorkload) -> Answer:
            r = engine.answer(work.chunks, work.question.question, mode, max_new_tokens=MAX_TOKENS,
                              speculative=speculative)  # fmt: skip
            return Answer(r.stats.ttft_ms, r.stats.total_ms, r.token_ids, r.stats.tokens_per_step)

        return run

    # speculation as a request that leaves it unset gets it (its draft policy) where that is on, else forced on
    speculation: bool | None = None if ModelRunner.of(engine.lm.model).speculates_by_default else True
    rows: dict[str, tuple[Peer, str | None]] = {}
    for mode in dict.fromkeys((engine.default_mode, "naive")):
        plain = f"pc-rag {mode}"
        rows[plain] = (answer(mode, False), None)
        rows[f"{plain} + speculation"] = (answer(mode, speculation), plain)
    return rows


def _measure(peer: str, run: Peer, work: AnswerWorkload, runs: int) -> AnswerRow:
    return measure(peer, lambda: run(work), len(work.ids), work.question.id, runs)


@contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """``count`` processes spinning in Python beside the block: a machine that is doing something else."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5 if loops else 0)  # let them reach their loop
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def run_answers(
    engine: RagEngine,
    lengths: Sequence[int],
    questions: int,
    runs: int,
    gguf: str | None,
    busy: Sequence[int] = (),
    log: Callable[[str], None] = print,
) -> list[AnswerRow]:
    """Every peer on ``questions`` sample questions at every length, idle; then the default mode with
    speculation at the first length beside each count of ``busy`` loops."""
    rows: list[AnswerRow] = []
    peers = engine_peers(engine)
    threads = torch.get_num_threads()
    works = []
    for target in lengths:
        for question in sample_questions()[:questions]:
            work = answer_workload(engine, question, target)
            works.append(work)
            done: dict[str, AnswerRow] = {}
            for name, (run, plain) in peers.items():
                row = _measure(name, run, work, runs)
                row.threads = threads
                if plain is not None and plain in done and row.note == "":
                    row.same_as_plain = row.token_ids == done[plain].token_ids
                done[name] = row
                rows.append(row)
                log(line(row))
    reason = unavailable(gguf)
    if reason is not None:
        rows += [AnswerRow(name, 0, "", note=reason) for name in LLAMA_CPP_ROWS]
    else:  # in a process of its own, after ours: the two runtimes' thread pools never meet
        job = {
            "gguf": gguf, "threads": threads, "context": max(lengths) + MAX_TOKENS + 256, "runs": runs,
            "stop_ids": sorted(engine.stop_ids),
            "works": [{"question": w.question.id, "ids": w.ids, "documents": w.documents} for w in works],
        }  # fmt: skip
        rows += llama_cpp_rows(job)
    default = f"pc-rag {engine.default_mode} + speculation"
    work = answer_workload(engine, sample_questions()[0], lengths[0])
    policy = free_cores_used()
    for count in busy:
        for auto in (False, True):  # a fixed thread count, then the cores the busy loops leave free
            use_free_cores(auto)
            torch.set_num_threads(threads)
            with busy_loops(count):
                row = _measure(busy_peer(default, auto, threads), peers[default][0], work, runs)
            row.busy, row.threads = count, torch.get_num_threads()
            rows.append(row)
            log(line(row))
    use_free_cores(policy)
    torch.set_num_threads(threads)
    return rows


def busy_peer(default: str, auto: bool, threads: int) -> str:
    """The name of a busy-section row: the default mode with ``--threads auto`` or a fixed count."""
    return f"{default}{AUTO}" if auto else f"{default} (--threads {threads})"


def summary(rows: Sequence[AnswerRow]) -> list[dict[str, object]]:
    """Per (peer, length, busy loops): medians over questions of TTFT, answer time, decode speed and tokens per
    step, and how many outputs equal the peer's plain decoding."""
    groups: dict[tuple[str, int, int], list[AnswerRow]] = {}
    for r in rows:
        if r.answer_ms is not None:
            groups.setdefault((r.peer, _length_class(r.context_tokens), r.busy), []).append(r)
    out = []
    for (peer, length, busy), group in groups.items():
        same = [r.same_as_plain for r in group if r.same_as_plain is not None]
        out.append({
            "peer": peer, "length": length, "busy": busy, "questions": len(group),
            "ttft_ms": _median(r.ttft_ms for r in group), "answer_ms": _median(r.answer_ms for r in group),
            "tokens": _median(r.tokens for r in group),
            "decode_tokens_per_s": _median(r.decode_tokens_per_s for r in group),
            "tokens_per_step": _median(r.tokens_per_step for r in group),
            "same_as_plain": f"{sum(same)}/{len(same)}" if same else "",
        })  # fmt: skip
    return out


def gates(rows: Sequence[AnswerRow], default_mode: str) -> list[dict[str, object]]:
    """Issue 37's acceptance lines, each ``{name, value, threshold, op, met}``; a gate whose rows are missing
    (llama.cpp not installed) is reported with value None and not met."""
    ours, plain = f"pc-rag {default_mode} + speculation", f"pc-rag {default_mode}"
    warm = LLAMA_CPP_ROWS[1]
    idle = [r for r in rows if r.answer_ms is not None and r.busy == 0]
    by = {(r.peer, _length_class(r.context_tokens), r.question): r for r in idle}
    out: list[dict[str, object]] = []

    def gate(name: str, value: float | None, threshold: float, op: str) -> None:
        met = value is not None and (value <= threshold if op == "<=" else value >= threshold)
        out.append({"name": name, "value": value, "threshold": threshold, "op": op, "met": met})

    same = [r.same_as_plain for r in idle if r.same_as_plain is not None and r.peer.startswith("pc-rag")]
    gate("greedy output with speculation = plain, share of rows", sum(same) / len(same) if same else None, 1.0, ">=")
    for length in sorted({k[1] for k in by}):
        pairs = [(r, by.get((warm, length, r.question))) for (p, n, _), r in by.items() if p == ours and n == length]
        pairs = [(r, w) for r, w in pairs if w is not None]
        ratio = _median(r.answer_ms / w.answer_ms for r, w in pairs)
        gate(f"answer time, {ours} / llama.cpp warm, {length} tokens", ratio, 1.0, "<=")
        speeds = _median(
            r.decode_tokens_per_s / w.decode_tokens_per_s
            for r, w in pairs
            if r.decode_tokens_per_s and w.decode_tokens_per_s
        )
        gate(f"decode tokens/s, {ours} / llama.cpp plain decode, {length} tokens", speeds, 1.0, ">=")
    gains = [
        r.decode_tokens_per_s / base.decode_tokens_per_s
        for (p, n, q), r in by.items()
        if p == ours
        and (base := by.get((plain, n, q))) is not None
        and r.decode_tokens_per_s
        and base.decode_tokens_per_s
    ]
    gate("decode tokens/s, speculation / plain decode (median over questions)", _median(gains), 1.5, ">=")
    # the default mode beside busy loops: with the CLI's default (--threads auto) against the same peer idle
    busy = {r.busy: r.answer_ms for r in rows if r.peer == ours + AUTO and r.answer_ms is not None}
    if 1 in busy and 0 in busy:
        name = (
            f"answer time with one busy loop / idle, {ours + AUTO} (the CLI's default; first question, shortest length)"
        )
        gate(name, busy[1] / busy[0], 2.0, "<=")
    return out


def _length_class(tokens: int) -> int:
    """The target a prompt was padded to (1K, 4K or 8K), from its actual length."""
    return min((1024, 2048, 4096, 8000, 16000), key=lambda t: abs(t - tokens))


def _median(values: Iterable[float | int | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def markdown(result: dict[str, Any]) -> str:
    """The summary and the gates of a ``--json`` result as two Markdown tables."""
    head = "| peer | context | busy loops | TTFT ms | answer ms | tokens | decode tok/s | tokens/step | = plain |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]

    def cell(value: object, digits: int = 0) -> str:
        return "" if value is None else f"{value:,.{digits}f}" if isinstance(value, float | int) else str(value)

    for s in sorted(result["summary"], key=lambda s: (s["length"], s["busy"])):
        lines.append(
            f"| {s['peer']} | {s['length']:,} | {s['busy']} | {cell(s['ttft_ms'])} | {cell(s['answer_ms'])} | "
            f"{cell(s['tokens'])} | {cell(s['decode_tokens_per_s'], 1)} | {cell(s['tokens_per_step'], 2)} | "
            f"{s['same_as_plain']} |"
        )
    gates_table = ["| gate | value | threshold | met |", "|---|---|---|---|"]
    gates_table += [
        f"| {g['name']} | {cell(g['value'], 2)} | {g['op']} {g['threshold']} | {'yes' if g['met'] else 'no'} |"
        for g in result["gates"]
    ]
    return "\n".join(lines) + "\n\n" + "\n".join(gates_table)
