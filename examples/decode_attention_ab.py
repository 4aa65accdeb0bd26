"""The decode step's attention, A/B in one process: the token's own key merged by log-sum-exp (before) against one
flash pass over the cache that already holds it (``cache_attention``, now).

Both read a bfloat16 cache of SmolLM2's shape (3 KV heads of 64, 9 query heads) in place; calls alternate, at
lengths that vary by a few slots, and each row is the median of ``--calls`` per side. The step writes the new key
and value before attending, so the merge only added ~10 small ops per layer.

    python examples/decode_attention_ab.py --json examples/results/decode_attention_ab_xeon.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pc_rag.attention import FLASH_CPU
from pc_rag.bench.provenance import commit, machine
from pc_rag.runtime.decode_step import cache_attention

KV_HEADS, QUERY_HEADS, HEAD_DIM, SCALE = 3, 9, 64, 0.125


def merged(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int) -> torch.Tensor:
    """The former step: flash over the ``length`` cached slots, then the own key's score merged by log-sum-exp."""
    assert FLASH_CPU is not None
    folded = q.reshape(1, KV_HEADS, -1, HEAD_DIM)
    k, v = keys[:, :, length : length + 1], values[:, :, length : length + 1]
    out, lse = FLASH_CPU(folded, keys[:, :, :length], values[:, :, :length], scale=SCALE)[:2]
    own = (folded.float() * k.float()).sum(-1) * SCALE
    share = torch.sigmoid(lse - own).unsqueeze(-1)
    return torch.lerp(v.float().expand_as(out), out.float(), share).to(q.dtype).reshape(1, 1, -1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-context", default="1024,4096")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for length in (int(t) for t in args.tokens_context.split(",")):
        capacity = length + 64
        keys = torch.randn(1, KV_HEADS, capacity, HEAD_DIM, dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        q = torch.randn(1, QUERY_HEADS, 1, HEAD_DIM, dtype=torch.bfloat16)
        before: list[float] = []
        now: list[float] = []
        for call in range(args.calls):
            at = length + call % 7
            start = time.perf_counter()
            merged(q, keys, values, at)
            before.append(time.perf_counter() - start)
            start = time.perf_counter()
            cache_attention(q, keys[:, :, : at + 1], values[:, :, : at + 1], SCALE)
            now.append(time.perf_counter() - start)
        one_pass = cache_attention(q, keys[:, :, : length + 1], values[:, :, : length + 1], SCALE)
        gap = (merged(q, keys, values, length) - one_pass).abs().max()
        row = {"context_tokens": length, "merged_us": statistics.median(before) * 1e6,
               "one_pass_us": statistics.median(now) * 1e6, "max_abs_difference": gap.item(),
               "threads": torch.get_num_threads()}  # fmt: skip
        row["speedup"] = row["merged_us"] / row["one_pass_us"]
        print(f"{length:>6} tokens: merged {row['merged_us']:6.0f} us, one pass {row['one_pass_us']:6.0f} us "
              f"({row['speedup']:.2f}x), max |difference| {row['max_abs_difference']:.1e}")  # fmt: skip
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
