"""``pc-rag bench ttft``: time to first token, cached vs full prefill, on prompts built from modules.

Each prompt is a system turn, passage modules filling the context, and a ~50-token
uncached question. Per length it reports the median over ``runs`` of: full
prefill of the same tokens, cached serving (splice + compute the question), and
the floor (the question's forward alone on an already spliced cache). This
module knows nothing about retrieval; it drives the engine and a stopwatch.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pc_rag.assemble import forward_new_tokens, splice
from pc_rag.engine import PromptCache
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.kv import allocate
from pc_rag.pml.builder import PromptBuilder, SchemaBuilder
from pc_rag.pml.nodes import Prompt

QUESTION = (
    "Using only the passages above, answer the following question in a few words, naming the person, place "
    "or date it asks about, and do not add any explanation: which of the passages mentions a river, and "
    "what is its name?"
)


@dataclass
class TTFTRow:
    context_tokens: int
    full_ttft_ms: float
    cached_ttft_ms: float
    floor_ms: float
    speedup: float


def ttft_benchmark(pc: PromptCache, lengths: Sequence[int], runs: int = 3) -> list[TTFTRow]:
    """Measure every length in ``lengths`` (total prompt tokens); medians of ``runs`` after one warm-up."""
    rows = []
    for target in lengths:
        name, modules = _build_schema(pc, target)
        builder = PromptBuilder(name)
        for module_name in modules:
            builder.use(module_name)
        prompt = builder.user(QUESTION).build()
        ids = pc.full_prompt_ids(prompt)
        full, cached, floor = [], [], []
        for run in range(runs + 1):
            f = pc.generate_ids(ids, max_new_tokens=1).stats.ttft_ms
            c = pc.generate(prompt, max_new_tokens=1).stats.ttft_ms
            fl = _floor_ms(pc, prompt)
            if run:  # the first round warms up allocators and kernels
                full.append(f)
                cached.append(c)
                floor.append(fl)
        f_med, c_med = statistics.median(full), statistics.median(cached)
        rows.append(TTFTRow(len(ids), f_med, c_med, statistics.median(floor), f_med / c_med))
        del pc.schemas[name]
    return rows


def _build_schema(pc: PromptCache, target: int) -> tuple[str, list[str]]:
    """Register a schema whose passages plus the question make about ``target`` tokens; return its modules."""
    name = f"bench{target}"
    builder = SchemaBuilder(name).system("You answer questions about the passages you are given.")
    modules = []
    budget = target - len(pc.tokenize(QUESTION)) - 30  # chat wrappers and system turn
    passages = [p for q in sample_questions() for p in q.passages]
    for i, (title, text) in enumerate(passages):
        ids = pc.tokenize(f"Passage {i + 1}:\n{title}\n{text}\n\n")[:budget]  # the last one is cut to fit
        if not ids:
            break
        budget -= len(ids)
        builder.module(f"p{i}", pc.lm.tokenizer.decode(ids))
        modules.append(f"p{i}")
    pc.add_schema(builder.build())
    return name, modules


def _floor_ms(pc: PromptCache, prompt: Prompt) -> float:
    """The forward of the uncached tokens alone on an already spliced cache, plus picking the token."""
    request = pc.request(prompt, max_new_tokens=1)
    buffer = allocate(pc.lm.model, request.spliced + len(request.new_ids) + 1)
    length = splice(buffer, pc.lm.rope, [(part.kv, part.shift) for part in request.parts])
    start = time.perf_counter()
    logits, _ = forward_new_tokens(pc.lm.model, buffer, length, request.new_ids, request.new_positions)
    int(logits.argmax())
    return (time.perf_counter() - start) * 1000


def print_table(rows: Sequence[TTFTRow]) -> None:
    print(f"{'context':>8} {'full ms':>9} {'cached ms':>10} {'floor ms':>9} {'speedup':>8} {'cached/floor':>13}")
    for r in rows:
        ratio = r.cached_ttft_ms / r.floor_ms
        print(f"{r.context_tokens:>8} {r.full_ttft_ms:>9.1f} {r.cached_ttft_ms:>10.1f} {r.floor_ms:>9.1f} "
              f"{r.speedup:>7.1f}x {ratio:>12.2f}x")  # fmt: skip


def plot_ttft(rows: Sequence[TTFTRow], path: Path) -> None:
    """TTFT against context length, cached vs full prefill, log scale (needs matplotlib: pc-rag[eval])."""
    from pc_rag.eval.report import require_matplotlib

    require_matplotlib()
    from matplotlib.figure import Figure  # a bare Figure renders with Agg and leaves pyplot's state alone

    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    tokens = [r.context_tokens for r in rows]
    ax.plot(tokens, [r.full_ttft_ms for r in rows], "o-", label="full prefill")
    ax.plot(tokens, [r.cached_ttft_ms for r in rows], "o-", label="pc-rag cached")
    for r in rows:
        label = f"{r.speedup:.0f}x"
        ax.annotate(label, (r.context_tokens, r.cached_ttft_ms), textcoords="offset points", xytext=(0, 6))
    ax.set(xlabel="context tokens", ylabel="TTFT (ms)", yscale="log", title="Time to first token, cached vs full")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
