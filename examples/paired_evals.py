"""Two runs of ``pc-rag eval`` on the same questions, paired: how many answers are the same tokens, and F1's change.

A kernel that sums in another order changes a bfloat16 model's greedy answers here and there; whether that moves
quality shows in the paired F1 difference per mode, not in either run's F1 against full prefill alone. Give each
run's per-question state file (``--state``, or the ``--json`` path + ``.partial.jsonl``):

    python examples/paired_evals.py --base aten.json.partial.jsonl --new dot.json.partial.jsonl \
        --json examples/results/dot_linear_dev30.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pc_rag.eval import paired_bootstrap_ci


def records(path: Path) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    """(setting, dataset, question id, mode) -> that question's row."""
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {(r["setting"], r["dataset"], r["id"], r["mode"]): r for r in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the reference run's state file")
    parser.add_argument("--new", type=Path, required=True, help="the changed run's state file")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    base, new = records(args.base), records(args.new)
    shared = sorted(base.keys() & new.keys())
    if not shared:
        parser.error(f"{args.base} and {args.new} share no (setting, dataset, question, mode)")
    rows = []
    print(f"{'mode':>8} {'n':>4} {'same answer':>11} {'F1 base':>8} {'F1 new':>7} {'dF1':>6}  95% CI")
    for mode in sorted({key[3] for key in shared}):
        keys = [key for key in shared if key[3] == mode]
        deltas = [100 * (new[k]["f1"] - base[k]["f1"]) for k in keys]
        same = sum(new[k]["answer"] == base[k]["answer"] for k in keys)
        f1 = {name: 100 * sum(run[k]["f1"] for k in keys) / len(keys) for name, run in (("base", base), ("new", new))}
        low, high = paired_bootstrap_ci(deltas)
        print(f"{mode:>8} {len(keys):>4} {same:>11} {f1['base']:>8.2f} {f1['new']:>7.2f} {f1['new'] - f1['base']:>6.2f}"
              f"  [{low:.2f}, {high:.2f}]")  # fmt: skip
        rows.append({"mode": mode, "n": len(keys), "same_answers": same, "f1_base": f1["base"], "f1_new": f1["new"],
                     "f1_delta": f1["new"] - f1["base"], "f1_delta_ci95": [low, high]})  # fmt: skip
    if args.json:
        payload = {"base": str(args.base), "new": str(args.new), "rows": rows}
        args.json.write_text(json.dumps(payload, indent=1) + "\n")


if __name__ == "__main__":
    main()
