"""``pc-rag bench peers --answers``: the time to a whole answer, ours against llama.cpp on the same GGUF.

A user waits for the answer, not its first token. Each workload is a real question of the bundled sample with
its own passages, padded with other sample passages to about ``target`` tokens, in the ``ask`` prompt. Every peer
answers it greedily, up to 64 tokens, stopping at EOS; a row is one (peer, length, question), timed as the median
of ``runs`` answers after a warm-up, with its TTFT, decode tokens/s, tokens generated, tokens per decode step and
whether its output equals the same peer's plain decoding. Our rows: the default mode and ``naive``, each with
speculation and without. llama.cpp (``llama-cpp-python``, same threads): full prefill, its prefix cache warm
(the documents were evaluated by an earlier request) and prompt-lookup decoding on the warm prefix. ``busy``
loops (plain Python processes spinning) can run beside the timing. This module knows nothing about how serving
works; it times engines and libraries.
"""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from pc_rag.bench.peers import _passage_budget
from pc_rag.errors import PCRagError
from pc_rag.hotpotqa_sample import SampleQuestion, sample_questions
from pc_rag.rag.engine import Chunk, RagEngine
from pc_rag.runtime.threads import use_free_cores

MAX_TOKENS = 64
AUTO = " (--threads auto)"
LLAMA_CPP_ROWS = ("llama.cpp full prefill", "llama.cpp, prefix cache warm", "llama.cpp, prompt lookup (warm)")


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


@dataclass(frozen=True)
class AnswerWorkload:
    question: SampleQuestion
    chunks: list[Chunk]
    ids: list[int]  # the whole prompt, for peers that take tokens
    documents: int  # tokens up to the question: what a prefix cache holds across questions


def answer_workload(engine: RagEngine, question: SampleQuestion, target: int) -> AnswerWorkload:
    """``question``'s passages first, then other sample passages, until the prompt holds about ``target``
    tokens (the last passage cut)."""
    budget = _passage_budget(engine, target)
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

    def answer(mode: str, speculative: bool) -> Peer:
        def run(work: AnswerWorkload) -> Answer:
            r = engine.answer(work.chunks, work.question.question, mode, max_new_tokens=MAX_TOKENS,
                              speculative=speculative)  # fmt: skip
            return Answer(r.stats.ttft_ms, r.stats.total_ms, r.token_ids, r.stats.tokens_per_step)

        return run

    rows: dict[str, tuple[Peer, str | None]] = {}
    for mode in dict.fromkeys((engine.default_mode, "naive")):
        plain = f"pc-rag {mode}"
        rows[plain] = (answer(mode, False), None)
        rows[f"{plain} + speculation"] = (answer(mode, True), plain)
    return rows


def llama_cpp_peers(gguf: str | None, stop_ids: frozenset[int], context: int) -> dict[str, tuple[Peer, str | None]]:
    """llama.cpp's rows, or each row's reason when it cannot run here."""
    if importlib.util.find_spec("llama_cpp") is None:
        reason = "llama-cpp-python is not installed (pip install llama-cpp-python; it compiles llama.cpp)"
        raise _Unavailable(reason)
    if gguf is None:
        raise _Unavailable("the model was not loaded from a GGUF file")
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = torch.get_num_threads()  # llama-cpp-python's default is half the cores
    settings = {"n_ctx": context, "n_threads": threads, "n_threads_batch": threads, "verbose": False}
    plain = Llama(model_path=gguf, **settings)
    draft = LlamaPromptLookupDecoding(num_pred_tokens=10)
    lookup = Llama(model_path=gguf, draft_model=draft, logits_all=True, **settings)  # verifying reads every row
    stops = stop_ids | {plain.token_eos()}

    def cold(work: AnswerWorkload) -> Answer:
        plain.reset()  # forget every cached token: a full prefill
        return _llama_answer(plain, work.ids, stops)

    def warm(llm: Llama) -> Peer:
        def run(work: AnswerWorkload) -> Answer:
            # an earlier request held the same preamble and documents (another question); generate() reuses the
            # longest common prefix of its context, so only the question is computed, as in our cached path
            llm.reset()
            _llama_answer(llm, work.ids[: work.documents], stops, limit=1)
            return _llama_answer(llm, work.ids, stops)

        return run

    cold_row, warm_row, lookup_row = LLAMA_CPP_ROWS
    return {cold_row: (cold, None), warm_row: (warm(plain), None), lookup_row: (warm(lookup), warm_row)}


class _Unavailable(PCRagError):
    """A peer that cannot run here, with the reason."""


def _llama_answer(llm: object, prompt: list[int], stops: frozenset[int], limit: int = MAX_TOKENS) -> Answer:
    start = time.perf_counter()
    first, ids = 0.0, []
    for token in llm.generate(prompt, temp=0.0):  # type: ignore[attr-defined]
        if not ids:
            first = (time.perf_counter() - start) * 1000
        if token in stops:
            break
        ids.append(token)
        if len(ids) == limit:
            break
    return Answer(first, (time.perf_counter() - start) * 1000, ids, None)  # llama.cpp does not say


def measure(peer: str, run: Peer, work: AnswerWorkload, runs: int) -> AnswerRow:
    """The median of ``runs`` answers after one warm-up (the outputs must not change between runs)."""
    run(work)
    answers = [run(work) for _ in range(runs)]
    ids = answers[0].token_ids
    if any(a.token_ids != ids for a in answers):
        return AnswerRow(peer, len(work.ids), work.question.id, note="output changed between runs")
    total = statistics.median(a.total_ms for a in answers)
    first = statistics.median(a.first_ms for a in answers)
    decode_s = (total - first) / 1000
    speed = (len(ids) - 1) / decode_s if len(ids) > 1 and decode_s > 0 else None
    row = AnswerRow(peer, len(work.ids), work.question.id, first, total, len(ids), speed, answers[0].per_step)
    row.token_ids = ids
    return row


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
    context = max(lengths) + MAX_TOKENS + 256
    try:
        peers |= llama_cpp_peers(gguf, engine._stop_ids, context)
    except _Unavailable as e:
        rows += [AnswerRow(name, 0, "", note=str(e)) for name in LLAMA_CPP_ROWS]
    threads = torch.get_num_threads()
    for target in lengths:
        for question in sample_questions()[:questions]:
            work = answer_workload(engine, question, target)
            done: dict[str, AnswerRow] = {}
            for name, (run, plain) in peers.items():
                row = measure(name, run, work, runs)
                row.threads = threads
                if plain is not None and plain in done and row.note == "":
                    row.same_as_plain = row.token_ids == done[plain].token_ids
                done[name] = row
                rows.append(row)
                log(_line(row))
    default = f"pc-rag {engine.default_mode} + speculation"
    work = answer_workload(engine, sample_questions()[0], lengths[0])
    for count in busy:
        for auto in (False, True):  # torch's threads as they are, then the cores the busy loops leave free
            use_free_cores(auto)
            with busy_loops(count):
                row = measure(f"{default}{AUTO if auto else ''}", peers[default][0], work, runs)
            row.busy, row.threads = count, torch.get_num_threads()
            use_free_cores(False)
            torch.set_num_threads(threads)
            rows.append(row)
            log(_line(row))
    return rows


def _line(r: AnswerRow) -> str:
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
    idle_first = next((r.answer_ms for r in rows if r.peer == ours and r.busy == 0 and r.answer_ms), None)
    for peer in (ours, ours + AUTO):
        busy = {r.busy: r.answer_ms for r in rows if r.peer == peer and r.busy and r.answer_ms is not None}
        if 1 in busy and idle_first:
            name = f"answer time with one busy loop / idle, {peer} (first question, shortest length)"
            gate(name, busy[1] / idle_first, 2.0, "<=")
    return out


def machine() -> dict[str, str]:
    """The CPU's model name and the vector extensions that decide which kernels run."""
    info = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return {
        "model": fields.get("Model name", "").strip(),
        "flags": " ".join(f for f in wanted if f in flags),
        "cores": str(torch.get_num_threads()),
    }


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
