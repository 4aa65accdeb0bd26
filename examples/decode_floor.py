"""One decode step against its floor: the bytes a step must read over the bandwidth this machine reads at.

A decode step reads every weight once and the whole KV cache once, so its time cannot go below
(weight bytes + KV bytes) / read bandwidth. This script serves a cached answer (each ``--mode``, ``naive`` by
default; the ``ask`` prompt on a bundled sample question padded to each length, EOS ignored so every answer has
``--tokens`` steps), times each decode step (``DecodeStep``: the step every mode runs on CPU), profiles
``--profile`` of them with ``torch.profiler`` and reports the gap to the floor with the ops that take the time.
Bandwidth is measured here, as the median of summing a 1 GiB float32 tensor with the same threads.

    python examples/decode_floor.py --dtype float32 --dtype int4 --tokens-context 1024,4096 \
        --json examples/results/decode_floor_xeon.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from pc_rag.bench.answer_time import answer_workload
from pc_rag.bench.provenance import commit, machine
from pc_rag.bench.timing import read_bandwidth_gb_s
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.model import load_model
from pc_rag.rag import RagEngine
from pc_rag.runtime.decode_step import DecodeStep
from pc_rag.weights import QuantizedLinear


def weight_bytes(model: nn.Module) -> int:
    """What one decode step reads of the weights: each linear layer's kernel tensors (quantized) or weight, and
    the norms; the embedding row it gathers is left out (one row)."""
    total, seen = 0, set()
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            tensors = module.kernel_tensors() or (module.weight,)
        elif isinstance(module, nn.Linear):
            tensors = (module.weight,)
        elif isinstance(module, nn.Embedding):
            continue
        else:
            tensors = tuple(module.parameters(recurse=False))
        for t in (*tensors, *([module.bias] if getattr(module, "bias", None) is not None else [])):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def kv_bytes(model: nn.Module, tokens: int, dtype: torch.dtype) -> int:
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize
    return per_token * tokens


class StepTimer:
    """Within the block, times every ``DecodeStep`` call and profiles ``profiled`` of them (after 4)."""

    def __init__(self, profiled: int) -> None:
        self.times: list[float] = []
        self.profiled = profiled
        self.profiler = profile(activities=[ProfilerActivity.CPU])
        self._original = DecodeStep.__call__
        self._profiling = False

    def __enter__(self) -> StepTimer:
        timer, original = self, self._original

        def timed(step: DecodeStep, *args: object, **kwargs: object) -> torch.Tensor:
            if len(timer.times) == 4:
                timer.profiler.start()
                timer._profiling = True
            start = time.perf_counter()
            out = original(step, *args, **kwargs)  # type: ignore[arg-type]
            timer.times.append(time.perf_counter() - start)
            if len(timer.times) == 4 + timer.profiled:
                timer._stop()
            return out

        DecodeStep.__call__ = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        DecodeStep.__call__ = self._original  # type: ignore[method-assign]
        if self._profiling:  # the answer took fewer steps than asked for (speculation keeps several tokens a step)
            self.profiled = len(self.times) - 4
            self._stop()

    def _stop(self) -> None:
        self.profiler.stop()
        self._profiling = False


def measure(
    dtype: str,
    contexts: list[int],
    tokens: int,
    profiled: int,
    bandwidth: float,
    modes: list[str],
    speculative: bool | None = None,
) -> list[dict]:
    lm = load_model(dtype=dtype)
    engine = RagEngine(lm)
    engine.stop_ids = frozenset()  # every answer runs all its steps
    rows = []
    for target, mode in ((t, m) for t in contexts for m in modes):
        work = answer_workload(engine, sample_questions()[0], target)
        timer = StepTimer(profiled)
        answer = partial(engine.answer, work.chunks, work.question.question, mode, max_new_tokens=tokens,
                         speculative=speculative)  # fmt: skip
        answer()  # warm-up
        with timer:
            result = answer()
        times, prof, profiled_steps = timer.times, timer.profiler, timer.profiled  # fewer if the answer ended first
        step_ms = statistics.median(times[2:]) * 1000
        weights, kv = weight_bytes(lm.model), kv_bytes(lm.model, len(work.ids) + tokens // 2, lm.dtype)
        floor_ms = (weights + kv) / (bandwidth * 1e9) * 1000
        averages = prof.key_averages()
        ops = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
        ops_ms = sum(e.self_cpu_time_total for e in averages) / 1000 / profiled_steps  # the rest: Python between ops
        row = {
            "dtype": dtype, "mode": mode, "context_tokens": len(work.ids), "step_ms": step_ms, "steps": len(times),
            "weight_bytes": weights, "kv_bytes": kv, "bandwidth_gb_s": bandwidth, "floor_ms": floor_ms,
            "gap": step_ms / floor_ms, "decode_tokens_per_s": result.stats.decode_tokens_per_s,
            "tokens_per_step": result.stats.tokens_per_step, "ops_ms": ops_ms, "threads": torch.get_num_threads(),
            "top_ops": [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1000 / profiled_steps,
                         "calls_per_step": e.count / profiled_steps} for e in ops],
        }  # fmt: skip
        print(f"{dtype:>8} {mode:>6} {row['context_tokens']:>6} tok: step {step_ms:6.1f} ms, floor {floor_ms:5.1f} ms "
              f"({(weights + kv) / 1e6:.0f} MB at {bandwidth:.1f} GB/s), gap {row['gap']:.1f}x; "
              f"ops {ops_ms:.1f} ms/step; {row['decode_tokens_per_s']:.1f} tokens/s, "
              f"{row['tokens_per_step']:.2f} per step")  # fmt: skip
        for op in row["top_ops"]:
            print(f"{'':>17}{op['op']:<40} {op['self_ms_per_step']:6.2f} ms/step  {op['calls_per_step']:5.0f} calls")
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", action="append", help="compute dtypes (repeat); default float32")
    parser.add_argument("--tokens-context", default="1024,4096", help="comma-separated prompt lengths")
    parser.add_argument("--tokens", type=int, default=24, help="decode steps per answer")
    parser.add_argument("--profile", type=int, default=10, help="steps profiled (at least 1)")
    parser.add_argument("--mode", action="append", help="serving modes (repeat); default naive")
    parser.add_argument("--speculative", choices=("on", "off"), help="default: the runtime's choice")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.profile < 1:
        parser.error(f"--profile must be at least 1, got {args.profile}")
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [int(t) for t in args.tokens_context.split(",")]
    bandwidth = read_bandwidth_gb_s()
    print(f"read bandwidth: {bandwidth:.1f} GB/s with {torch.get_num_threads()} threads")
    modes = args.mode or ["naive"]
    speculative = None if args.speculative is None else args.speculative == "on"
    rows = [
        row
        for dtype in args.dtype or ["float32"]
        for row in measure(dtype, contexts, args.tokens, args.profile, bandwidth, modes, speculative)
    ]
    if args.json:
        provenance = {"machine": machine(), "commit": commit(), "rows": rows}
        args.json.write_text(json.dumps(provenance, indent=1) + "\n")


if __name__ == "__main__":
    main()
