"""Whether a GEMM gives a row the same bits at every row count: why ``BatchPrefill`` calls each request's rows alone.

For SmolLM2's layer shapes (q, k, v, o, gate/up and down projections), in float32 and bfloat16, this multiplies the
first ``--rows`` rows of a random input with ``M`` rows in all, for several ``M``, and says for each whether those
rows got the bits they get in a call of exactly ``--rows`` rows. Where one differs, packing requests' rows into one
call changes a request's logits (and, at near ties, its answer) against the request alone:

    python examples/gemm_row_bits.py --json examples/results/gemm_row_bits_xeon.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pc_rag.bench.provenance import commit, machine
from pc_rag.weights import dense_linear

SHAPES = {"q/o": (576, 576), "k/v": (192, 576), "gate/up": (1536, 576), "down": (576, 1536)}  # (out, in)


def same_bits(rows: int, totals: list[int], dtype: torch.dtype, seed: int = 0) -> dict[str, dict[str, bool]]:
    """Per shape and total row count: whether the first ``rows`` rows equal a call of ``rows`` rows bitwise."""
    g = torch.Generator().manual_seed(seed)
    found: dict[str, dict[str, bool]] = {}
    for name, (out_features, in_features) in SHAPES.items():
        weight = torch.randn(out_features, in_features, generator=g).to(dtype)
        x = torch.randn(max(totals), in_features, generator=g).to(dtype)
        alone = dense_linear(x[:rows], weight, None)
        found[name] = {str(m): torch.equal(dense_linear(x[:m], weight, None)[:rows], alone) for m in totals}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=96, help="the request's rows (a 96-token prompt)")
    parser.add_argument("--totals", default="96,128,256,512,1024,1536,2048", help="rows of the packed call")
    parser.add_argument("--small", type=int, default=4, help="also: a small call's rows against 16 and 64 rows")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    totals = [int(t) for t in args.totals.split(",")]
    report: dict[str, object] = {"machine": machine(), "commit": commit(), "threads": args.threads, "results": []}
    print(f"{'dtype':9} {'rows':>5} {'shape':8} " + " ".join(f"{m:>6}" for m in totals))
    for dtype in (torch.float32, torch.bfloat16):
        for rows, against in ((args.rows, totals), (args.small, [args.small, 16, 64])):
            found = same_bits(rows, against, dtype)
            report["results"].append({"dtype": str(dtype).removeprefix("torch."), "rows": rows, "same": found})
            for name, by_total in found.items():
                cells = " ".join(f"{'same' if by_total[str(m)] else 'OTHER':>6}" for m in against)
                print(f"{str(dtype).removeprefix('torch.'):9} {rows:>5} {name:8} {cells}   (M = {against})")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
