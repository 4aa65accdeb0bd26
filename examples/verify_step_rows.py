"""What a speculative step's rows cost: a verify step of 1 to 4 rows at each cache length (the draft policy's costs).

A verify step computes the fed token and its drafts as rows; each row adds its matmuls and its attention over the
whole cache (``runtime/draft_policy.py`` weighs drafts against this). This serves the ``ask`` prompt of a sample
question padded to each length, stops at its first decode step, and times ``ModelRunner.verify`` of 1 to 4 rows on
that cache (median of ``--steps`` after a warm-up, the row counts taking turns; the rows are cropped after each
call):

    python examples/verify_step_rows.py --dtype int4 --tokens-context 1024,4096,8192 \
        --json examples/results/verify_step_rows_xeon.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pc_rag.bench.answer_time import answer_workload
from pc_rag.bench.provenance import commit, machine
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.model import load_model
from pc_rag.rag import RagEngine
from pc_rag.runtime.decode_step import STEP_ROWS
from pc_rag.runtime.model_runner import ModelRunner


class _FirstStep(Exception):
    """Raised by the patched ``verify`` to stop the answer at its first decode step, carrying its arguments."""


def first_step(engine: RagEngine, target: int, mode: str) -> tuple[ModelRunner, int, int, object]:
    """The runner, fed token, position and cache of the first decode step of a sample answer at ``target`` tokens."""
    work = answer_workload(engine, sample_questions()[0], target)
    original = ModelRunner.verify

    def stop(self: ModelRunner, tokens: list[int], position: int, cache: object, rows: int = STEP_ROWS) -> None:
        raise _FirstStep(self, tokens[0], position, cache)

    ModelRunner.verify = stop  # type: ignore[method-assign,assignment]
    try:
        engine.answer(work.chunks, work.question.question, mode, max_new_tokens=8, speculative=True)
    except _FirstStep as step:
        return step.args  # type: ignore[return-value]
    finally:
        ModelRunner.verify = original  # type: ignore[method-assign]
    raise RuntimeError("the answer ended before its first decode step")


def step_times(runner: ModelRunner, token: int, position: int, cache: object, steps: int) -> dict[int, float]:
    """Median ms of ``runner.verify`` of 1 to ``STEP_ROWS`` rows over ``cache`` (after 5 warm-up rounds), the rows
    cropped after each call. The row counts take turns, so a machine that slows for a while slows each of them."""
    samples: dict[int, list[float]] = {count: [] for count in range(1, STEP_ROWS + 1)}
    with torch.inference_mode():
        for _ in range(steps + 5):
            for count, times in samples.items():
                start = time.perf_counter()
                runner.verify([token] * count, position, cache, rows=count)  # type: ignore[arg-type]
                times.append(time.perf_counter() - start)
                for layer in cache.layers:  # type: ignore[attr-defined]
                    layer.crop(-count)
    return {count: statistics.median(times[5:]) * 1000 for count, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--mode", default="naive")
    parser.add_argument("--tokens-context", default="1024,4096,8192")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    engine = RagEngine(load_model(dtype=args.dtype))
    rows = []
    for target in (int(t) for t in args.tokens_context.split(",")):
        runner, token, position, cache = first_step(engine, target, args.mode)
        length = cache.get_seq_length()  # type: ignore[attr-defined]
        times = step_times(runner, token, position, cache, args.steps)
        row = {"dtype": args.dtype, "mode": args.mode, "context_tokens": length, "threads": torch.get_num_threads(),
               "step_ms": times, "relative": {n: ms / times[1] for n, ms in times.items()}}  # fmt: skip
        cells = (f"{n} rows {ms:6.2f} ms ({ms / times[1]:.2f}x)" for n, ms in times.items())
        print(f"{length:>6} tokens: " + "  ".join(cells))
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
