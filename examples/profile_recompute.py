"""Where a ``default``-mode answer spends its time: deviation probe, recompute+question forward by operator class.

One thread (timings on a shared machine are only comparable within one process):

    OMP_NUM_THREADS=1 python examples/profile_recompute.py --tokens 1024,4096

Prompts are the LongBench RAG prompt over HotpotQA dev passages (``--data``), cut to about ``--tokens``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from pc_rag import load_model
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.engine import Chunk
from pc_rag.rag.modes import resolve_mode

QUESTION = "Which of the passages above mentions a river, and what is its name?"
DATA = Path(__file__).resolve().parents[2] / "shared/data/multidoc_qa/hotpotqa.jsonl"

# aten operator -> what it is part of in a decoder forward
KINDS = {
    "linear": ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm"),
    "attention kernel": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_flash_attention_forward",
                         "aten::_scaled_dot_product_attention_math", "aten::_efficient_attention_forward"),
}  # fmt: skip


def build_chunks(engine: RagEngine, target: int, data: Path) -> list[Chunk]:
    """Passages in file order until the prompt holds about ``target`` tokens, encoded for ``default``."""
    budget = target - len(engine.head_ids) - len(engine.tokenize(engine.prompt.tail(engine.wrappers, QUESTION)))
    texts: list[str] = []
    with data.open() as f:
        for line in f:
            for p in json.loads(line)["passages"]:
                ids = engine.tokenize(engine.passage_text(len(texts) + 1, p["title"], p["text"]))[:budget]
                if len(ids) < 8:
                    return engine.encode(texts, "default")
                texts.append(engine.lm.tokenizer.decode(ids))
                budget -= len(ids)
    return engine.encode(texts, "default")


def profile_answer(engine: RagEngine, chunks: list[Chunk]) -> dict[str, float]:
    """Milliseconds per part of one default-mode answer (first token): wall time of the probe and of the rest,
    then profiler self time by operator class within each (the profiler adds overhead; compare shares)."""
    mode = resolve_mode("default")
    original = engine._select
    probe_ms: list[float] = []

    def timed_select(*args: object) -> list[int]:
        start = time.perf_counter()
        with record_function("probe"):
            out = original(*args)
        probe_ms.append((time.perf_counter() - start) * 1000)
        return out

    engine._select = timed_select  # type: ignore[method-assign]
    try:
        engine.answer(chunks, QUESTION, mode, max_new_tokens=1)  # warm-up
        ttft = engine.answer(chunks, QUESTION, mode, max_new_tokens=1).stats.ttft_ms
        wall = {"ttft": ttft, "probe (wall)": probe_ms[-1], "rest (wall)": ttft - probe_ms[-1]}
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.answer(chunks, QUESTION, mode, max_new_tokens=1)
    finally:
        engine._select = original  # type: ignore[method-assign]
    events = prof.events()
    probe = next(e.time_range for e in events if e.name == "probe")
    totals: dict[str, float] = defaultdict(float)
    by_op: dict[str, float] = defaultdict(float)
    for event in events:
        part = "probe" if probe.start <= event.time_range.start <= probe.end else "forward"
        kind = next((k for k, names in KINDS.items() if event.name in names), "other")
        totals[f"{part}: {kind}"] += event.self_cpu_time_total / 1000
        if part == "forward":
            by_op[event.name] += event.self_cpu_time_total / 1000
    top = sorted(by_op.items(), key=lambda kv: kv[1], reverse=True)[:10]
    print(f"  forward top ops (self ms): {', '.join(f'{name} {ms:.0f}' for name, ms in top)}")
    return {**wall, **dict(sorted(totals.items()))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="1024,4096")
    parser.add_argument("--data", type=Path, default=DATA)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = RagEngine(load_model(), RagPrompt.longbench())
    for target in map(int, args.tokens.split(",")):
        chunks = build_chunks(engine, target, args.data)
        print(f"{len(engine.full_ids(chunks, QUESTION))} tokens")
        for part, ms in profile_answer(engine, chunks).items():
            print(f"  {part:<20} {ms:9.1f} ms")


if __name__ == "__main__":
    main()
