"""A decode step's quantized matmuls, ATen's fused kernels against pc-rag's dot-product kernel, per row count.

A decode step of SmolLM2 in ``int4`` multiplies 1 to 4 rows (the fed token and its drafts) by every projection
of every layer (q/k/v and gate/up joined, as the step calls them) and by the int8 output projection. This times
those calls in the step's order, over the real weights (so they stream from memory as in a step, not from the
caches), with ATen's kernels (``PC_RAG_DOT_LINEAR=0``) and ``csrc/dot_linear.cpp`` alternating in one process,
and keeps the fastest of ``--runs``. The floor is the bytes each reads over the measured read bandwidth:

    python examples/quantized_kernels.py --json examples/results/quantized_kernels_zen4.json
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from pc_rag.bench.provenance import commit, machine
from pc_rag.bench.timing import read_bandwidth_gb_s, timed_runs
from pc_rag.model import load_model
from pc_rag.runtime.cpu_kernels import DOT_SWITCH, dot_linear
from pc_rag.weights import QuantizedLinear

Call = tuple[type[QuantizedLinear], tuple[torch.Tensor, ...], int]  # kind, its kernel tensors, input width


def step_calls(model: torch.nn.Module, kernel: str) -> tuple[list[Call], list[Call]]:
    """The decoder layers' calls (q/k/v and gate/up joined) and the output projection's, for ``kernel``."""
    asked = os.environ.get(DOT_SWITCH)
    os.environ[DOT_SWITCH] = "1" if kernel == "dot" else "0"  # what joined() packs for
    try:
        return _step_calls(model)
    finally:
        if asked is None:
            os.environ.pop(DOT_SWITCH)
        else:
            os.environ[DOT_SWITCH] = asked


def _step_calls(model: torch.nn.Module) -> tuple[list[Call], list[Call]]:
    layers: list[Call] = []
    for layer in model.get_decoder().layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups = [[attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]]
        for group in groups:
            kind = type(group[0])
            tensors = kind.joined(group)
            assert tensors is not None, f"{kind.__name__} has no kernel here"
            layers.append((kind, tensors, group[0].in_features))
    head = model.get_output_embeddings()
    assert isinstance(head, QuantizedLinear)
    output = [(type(head), type(head).joined([head]), head.in_features)]
    return layers, output  # type: ignore[return-value]


def run(calls: list[Call], rows: int) -> Callable[[], None]:
    inputs = {width: torch.randn(rows, width).to(torch.bfloat16) for _, _, width in calls}

    def call_all() -> None:
        for kind, tensors, width in calls:
            kind.matmul(inputs[width], *tensors)

    return call_all


def read_bytes(calls: list[Call]) -> int:
    return sum(t.numel() * t.element_size() for _, tensors, _ in calls for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if dot_linear() is None:
        parser.error("the dot-product kernel cannot run here (it needs AVX-512 BF16)")
    torch.set_grad_enabled(False)
    model = load_model(dtype="int4").model
    calls = {kernel: step_calls(model, kernel) for kernel in ("aten", "dot")}
    bandwidth = read_bandwidth_gb_s()
    print(f"read bandwidth {bandwidth:.1f} GB/s, {torch.get_num_threads()} threads")
    print(f"{'part':>8} {'rows':>4} {'ATen ms':>8} {'dot ms':>7} {'ATen/dot':>8} {'floor ms':>9} {'dot/floor':>9}")
    results = []
    for part, index in (("layers", 0), ("output", 1)):
        floor_ms = {k: 1e3 * read_bytes(c[index]) / bandwidth / 1e9 for k, c in calls.items()}
        for rows in (int(r) for r in args.rows.split(",")):
            best = {kernel: float("inf") for kernel in calls}
            for _ in range(args.runs):  # alternating, so both see the same machine
                for kernel, kernel_calls in calls.items():
                    best[kernel] = min(best[kernel], 1e3 * timed_runs(run(kernel_calls[index], rows), 1)[0])
            print(f"{part:>8} {rows:>4} {best['aten']:>8.2f} {best['dot']:>7.2f} {best['aten'] / best['dot']:>8.2f}"
                  f" {floor_ms['dot']:>9.2f} {best['dot'] / floor_ms['dot']:>9.2f}")  # fmt: skip
            read_mb = {kernel: read_bytes(kernel_calls[index]) / 1e6 for kernel, kernel_calls in calls.items()}
            results.append({"part": part, "rows": rows, "aten_ms": best["aten"], "dot_ms": best["dot"],
                            "floor_ms": floor_ms, "read_mb": read_mb})  # fmt: skip
    if args.json:
        provenance = {"machine": machine(), "commit": commit(), "bandwidth_gb_s": bandwidth,
                      "threads": torch.get_num_threads(), "rows": results}  # fmt: skip
        args.json.write_text(json.dumps(provenance, indent=1) + "\n")


if __name__ == "__main__":
    main()
