"""Plot the speed-fidelity frontier from `pc-rag eval` JSON: every mode's speedup over full prefill against its
first-token and 8-token teacher-forced KL, with issue 12's gates drawn in.

    python examples/frontier_plot.py examples/results/frontier30.json --png examples/results/frontier30.png

Modes using the splice adapter are drawn as circles, the others as squares; the rows used are the ``--dataset``
aggregate (default ``all``) of each file, and the speedup is the ratio of TTFT medians in the same file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# (speedup, KL, label, panels): default's gate bounds both KLs, fast's only the first token's
GATES = ((5.0, 0.05, "default gate: >=5x, KL<=0.05", (0, 1)), (10.0, 0.10, "fast gate: >=10x, KL<=0.10", (0,)))


def frontier_points(paths: list[Path], dataset: str) -> list[dict]:
    """One point per (file, mode): name, speedup, first-token KL, 8-token KL."""
    points = []
    for path in paths:
        rows = [r for r in json.loads(path.read_text(encoding="utf-8"))["results"] if r["dataset"] == dataset]
        full = next(r for r in rows if r["mode"] == "full")
        for row in rows:
            if row["mode"] != "full" and row.get("ttft_ms_median"):
                points.append(
                    {
                        "mode": row["mode"],
                        "speedup": full["ttft_ms_median"] / row["ttft_ms_median"],
                        "first_token_kl": row["first_token_kl"],
                        "teacher_forced_kl": row.get("teacher_forced_kl"),
                    }
                )
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", type=Path)
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--dataset", default="all")
    args = parser.parse_args()
    points = frontier_points(args.json, args.dataset)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharex=True)
    panels = (("first_token_kl", "first-token KL(full||mode)"), ("teacher_forced_kl", "8-token teacher-forced KL"))
    for panel, (ax, (key, label)) in enumerate(zip(axes, panels, strict=True)):
        for p in points:
            if p[key] is None:
                continue
            marker = "o" if "adapter" in p["mode"] or p["mode"] == "fast" else "s"
            ax.scatter(p["speedup"], p[key], marker=marker, color="C0" if marker == "o" else "C1")
            ax.annotate(p["mode"], (p["speedup"], p[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for speedup, kl, gate, on in GATES:
            if panel not in on:
                continue
            ax.plot([speedup, speedup, 100], [0, kl, kl], linestyle="--", linewidth=0.8, color="gray")
            ax.annotate(gate, (speedup, kl), fontsize=7, color="gray", xytext=(3, -10), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlim(1, 20)
        ax.set_ylim(0, None)
        ax.set_xlabel("TTFT speedup over full prefill (ratio of medians)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    fig.suptitle("Speed against fidelity; circles use the splice adapter")
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
