"""Batched decode projections of an int4 model: the fused kernels 4 rows at a time against the dense copy.

A batched decode step of B rows computes every linear layer on B rows. The int8/int4 CPU kernels give a row the
bits it gets alone only in calls of at most ``KERNEL_ROWS`` rows, so the batched step calls them that many rows at a
time; the alternative is the layer's dense bfloat16 copy (``weights.dense_linear``: float32 GEMMs on a CPU without
bfloat16 arithmetic). This times both over every projection of every layer of SmolLM2 in ``int4``, alternating, and
keeps the fastest of ``--runs``:

    python examples/kernel_rows_ab.py --rows 8,16,32 --json examples/results/kernel_rows_ab_xeon.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pc_rag.bench.provenance import commit, machine
from pc_rag.bench.timing import timed_runs
from pc_rag.model import load_model
from pc_rag.runtime.decode_step import by_kernel_rows
from pc_rag.weights import QuantizedLinear, dense_linear


def projections(model: torch.nn.Module) -> list[QuantizedLinear]:
    return [m for m in model.get_decoder().layers.modules() if isinstance(m, QuantizedLinear)]


def dense(layers: list[QuantizedLinear], x: torch.Tensor) -> None:
    for layer in layers:
        dense_linear(x[..., : layer.in_features], layer.weight, layer.bias)


def kernel_groups(layers: list[QuantizedLinear], x: torch.Tensor) -> None:
    for layer in layers:  # as the batched step calls them
        by_kernel_rows(layer, x[..., : layer.in_features], fused=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="8,16,32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    layers = projections(load_model(dtype="int4").model)
    widest = max(layer.in_features for layer in layers)
    rows_out = []
    print(f"{'rows':>5} {'kernels, 4 rows at a time':>26} {'dense copy':>11}")
    for count in (int(r) for r in args.rows.split(",")):
        x = torch.randn(count, 1, widest, dtype=torch.bfloat16)
        kernel_ms = dense_ms = float("inf")
        for _ in range(args.runs):  # alternating, so both see the same machine
            kernel_ms = min(kernel_ms, 1000 * timed_runs(lambda x=x: kernel_groups(layers, x), 1)[0])
            dense_ms = min(dense_ms, 1000 * timed_runs(lambda x=x: dense(layers, x), 1)[0])
        print(f"{count:>5} {kernel_ms:>23.1f} ms {dense_ms:>8.1f} ms")
        rows_out.append({"rows": count, "kernel_groups_ms": kernel_ms, "dense_ms": dense_ms, "projections": len(layers),
                         "threads": torch.get_num_threads()})  # fmt: skip
    if args.json:
        provenance = {"machine": machine(), "commit": commit(), "rows": rows_out}
        args.json.write_text(json.dumps(provenance, indent=1) + "\n")


if __name__ == "__main__":
    main()
