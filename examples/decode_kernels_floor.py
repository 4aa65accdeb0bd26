"""The kernels a CPU decode step spends its time in, each against the bytes it must read over the read bandwidth.

``decode_floor.py`` profiles whole steps; this script times the kernels PyTorch offers for their two heavy parts,
at the model's shapes, one layer's call at a time: one token's attention over a cache of each length (the query
heads folded onto their KV head, as ``cache_attention`` calls it) and the weight-only quantized matmuls of one
row. Each row gives microseconds per call (median of ``--calls``, cycling through copies of the tensors larger
than the L3 cache, as a step reads them), what the call must read, the GB/s that makes and its gap to the floor
(bytes / the bandwidth ``sum`` reads a 1 GiB tensor at, same threads). Alternatives are
timed beside PyTorch's kernels: pc-rag's own attention kernel where it runs (``runtime/cpu_kernels.py``), the
float32 cache, the cache split in parts merged by log-sum-exp (flash-decoding), the attention as
inductor-compiled reductions (``--compile``; needs a C++ compiler), and float32 activations into the int4 kernel.

    python examples/decode_kernels_floor.py --compile --json examples/results/decode_kernels_zen3.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from pc_rag.attention import FLASH_CPU
from pc_rag.bench.provenance import commit, machine
from pc_rag.bench.timing import read_bandwidth_gb_s, timed_runs
from pc_rag.model import load_model
from pc_rag.runtime.cpu_kernels import decode_attention
from pc_rag.runtime.verify_attention import BucketedAttention
from pc_rag.weights import Int4Linear, Int8Linear

SPAN = 96 << 20
"""Bytes each kernel's calls cycle through (copies of its tensors), well past the L3 cache, so that every call
reads from memory as a step does (a step reads ~100 MB of weights and the cache between two calls of a layer)."""


def copies(read: int) -> int:
    return max(2, -(-SPAN // read))


def median_us(calls: list[Callable[[], object]], timed: int) -> float:
    """Median microseconds of ``timed`` calls (after one warm-up), taking ``calls`` (one per copy of the tensors)
    in turn."""
    turns = itertools.cycle(calls)
    return statistics.median(timed_runs(lambda: next(turns)(), timed)) * 1e6


def split_flash(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, parts: int, scale: float) -> torch.Tensor:
    """Flash-decoding: the cache as ``parts`` batch entries, their outputs merged by log-sum-exp (float32)."""
    assert FLASH_CPU is not None
    heads, length, dim = keys.shape[1:]
    split_keys = keys[0].view(heads, parts, length // parts, dim).transpose(0, 1)
    split_values = values[0].view(heads, parts, length // parts, dim).transpose(0, 1)
    out, lse = FLASH_CPU(q.expand(parts, -1, -1, -1), split_keys, split_values, scale=scale)[:2]
    weights = torch.softmax(lse, dim=0)  # [parts, H_kv, n_rep]
    return (out.float() * weights[..., None]).sum(0).to(q.dtype)


def reductions(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention as two reductions over the cache, each key and value read once, in float32."""
    scores = (q[0, :, :, None, :].float() * keys[0, :, None].float()).sum(-1) * scale  # [H_kv, n_rep, S]
    return (torch.softmax(scores, -1)[..., None] * values[0, :, None].float()).sum(-2)


def attention_rows(config: object, lengths: list[int], calls: int, bandwidth: float, compile_: bool) -> list[dict]:
    assert FLASH_CPU is not None
    kv_heads, heads = config.num_key_value_heads, config.num_attention_heads  # type: ignore[attr-defined]
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads  # type: ignore[attr-defined]
    scale, rows = dim**-0.5, []
    compiled = torch.compile(reductions, dynamic=True) if compile_ else None
    ours = decode_attention()
    for length in lengths:
        for dtype in (torch.bfloat16, torch.float32):
            read, shape = 2 * kv_heads * length * dim * dtype.itemsize, f"{length} slots, cache {str(dtype)[6:]}"
            tensors = [
                (torch.randn(1, kv_heads, heads // kv_heads, dim).to(dtype),
                 *(torch.randn(1, kv_heads, length, dim).to(dtype) for _ in range(2)))
                for _ in range(copies(read))
            ]  # fmt: skip
            kernels = {"flash": [partial(FLASH_CPU, *t, scale=scale) for t in tensors]}
            if ours is not None:  # the step's kernel where it runs: q in float32, the cache [H_kv, S, D]
                ends = torch.tensor([length])
                kernels["pc-rag kernel"] = [partial(ours, q.float(), k[0], v[0], ends, scale) for q, k, v in tensors]
            if dtype == torch.bfloat16:  # a verify step: 4 rows at the last 4 slots
                verify = BucketedAttention(length - 4, 4, dtype, torch.device("cpu"))
                rows4 = torch.randn(4, heads, 1, dim).to(dtype)
                kernels["flash, 4 rows (buckets)"] = [partial(verify, rows4, k, v, scale) for _, k, v in tensors]
                if ours is not None:
                    ends4, q4 = torch.arange(length - 3, length + 1), rows4.reshape(4, kv_heads, -1, dim).float()
                    four = [partial(ours, q4, k[0], v[0], ends4, scale) for _, k, v in tensors]
                    kernels["pc-rag kernel, 4 rows"] = four
            if dtype == torch.bfloat16:
                parts = 8 if length % 8 == 0 and length >= 4096 else 2
                kernels[f"flash, split in {parts}"] = [partial(split_flash, *t, parts, scale) for t in tensors]
                if compiled is not None:
                    kernels["inductor reductions"] = [partial(compiled, *t, scale) for t in tensors]
            rows += [row("attention", name, shape, read, call, calls, bandwidth) for name, call in kernels.items()]
    return rows


def linear_rows(config: object, calls: int, bandwidth: float) -> list[dict]:
    hidden, inter = config.hidden_size, config.intermediate_size  # type: ignore[attr-defined]
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads  # type: ignore[attr-defined]
    dim = getattr(config, "head_dim", None) or hidden // heads
    shapes = {"q/k/v fused": ((heads + 2 * kv_heads) * dim, hidden), "o": (hidden, heads * dim),
              "gate/up fused": (2 * inter, hidden), "down": (hidden, inter)}  # fmt: skip
    rows = []
    for name, (out_features, in_features) in shapes.items():
        for activations in (torch.bfloat16, torch.float32):
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            tensors = Int4Linear.quantize(linear, activations).kernel_tensors()
            assert tensors is not None
            x = torch.randn(1, in_features).to(activations)
            read = sum(t.numel() * t.element_size() for t in tensors)
            many = [partial(Int4Linear.matmul, x, *(t.clone() for t in tensors)) for _ in range(copies(read))]
            rows.append(row("int4 matmul, 1 row", name, f"activations {str(activations)[6:]}", read, many, calls,
                            bandwidth))  # fmt: skip
    vocab = config.vocab_size  # type: ignore[attr-defined]
    head = Int8Linear.quantize(torch.nn.Linear(hidden, vocab, bias=False), torch.bfloat16)
    tensors = head.kernel_tensors()
    assert tensors is not None
    x = torch.randn(1, hidden).bfloat16()
    read = sum(t.numel() * t.element_size() for t in tensors)
    many = [partial(Int8Linear.matmul, x, *(t.clone() for t in tensors)) for _ in range(copies(read))]
    rows.append(row("int8 matmul, 1 row", "lm_head", "activations bfloat16", read, many, calls, bandwidth))
    return rows


def row(part: str, kernel: str, shape: str, read: int, call: list[Callable[[], object]], calls: int, bw: float) -> dict:
    us = median_us(call, calls)
    floor_us = read / (bw * 1e9) * 1e6
    result = {"part": part, "kernel": kernel, "shape": shape, "us": us, "bytes": read, "gb_s": read / us / 1e3,
              "floor_us": floor_us, "gap": us / floor_us}  # fmt: skip
    print(f"{part:<20} {kernel:<22} {shape:<30} {us:8.0f} us  {read / 1e6:6.2f} MB  {result['gb_s']:5.1f} GB/s  "
          f"gap {result['gap']:4.1f}x")  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-context", default="1024,4096,8192", help="cache lengths, comma-separated")
    parser.add_argument("--calls", type=int, default=200, help="timed calls per kernel (median)")
    parser.add_argument("--compile", action="store_true", help="also time the inductor-compiled reductions")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_model(dtype="float32").model.config
    bandwidth = read_bandwidth_gb_s()
    print(f"read bandwidth {bandwidth:.1f} GB/s, {torch.get_num_threads()} threads; per layer: "
          f"{config.num_hidden_layers} layers a step")  # fmt: skip
    lengths = [int(t) for t in args.tokens_context.split(",")]
    rows = attention_rows(config, lengths, args.calls, bandwidth, args.compile)
    rows += linear_rows(config, args.calls, bandwidth)
    if args.json:
        result = {"machine": machine(), "commit": commit(), "bandwidth_gb_s": bandwidth,
                  "threads": torch.get_num_threads(), "layers": config.num_hidden_layers, "rows": rows}  # fmt: skip
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
