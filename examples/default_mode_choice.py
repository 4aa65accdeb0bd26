"""Choose the default recovery mode from the committed measurements (issue 32), and say why, as JSON.

Reads the full dev runs (``closed_dev12.json``, ``open_dev12.json``: 554 questions, the tuning split
excluded, every mode that has both), the 30-question frontier (``frontier30.json``: more modes, closed
contexts) and the user-style check (``user_docs_modes.json``, ``examples/user_docs_check.py``), and writes
one row per mode and setting: F1 and its change against full prefill with the paired 95% interval,
first-token KL, answers identical to full prefill, speedup of TTFT medians, and the user-docs counts.

The rule, applied to the full dev runs in both settings: (1) at least ``MIN_SPEEDUP`` x full prefill's TTFT
(issue 12's speed target for the default); (2) among those, F1 not worse than full prefill beyond noise (the
interval's upper bound >= 0) in both settings, the best mean change first; (3) if no mode passes (2), the
lowest mean first-token KL. It is applied once to every mode and once to modes that need no trained file
(the fallback for a model without a splice adapter). This script knows nothing about serving; it reads JSON.

    python examples/default_mode_choice.py --json examples/results/default_mode_choice.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from pc_rag.rag.modes import resolve_mode

RESULTS = Path(__file__).resolve().parent / "results"
DEV = {"closed": "closed_dev12.json", "open": "open_dev12.json"}  # the full dev runs that include `fast`
FRONTIER = "frontier30.json"  # 30 questions, closed: modes without a full dev run
USER_DOCS = "user_docs_modes.json"
MIN_SPEEDUP = 5.0

Row = dict[str, Any]


def rows_of(name: str, setting: str) -> list[Row]:
    """The ``all`` rows of an eval JSON, as the choice table's rows (speedup over the same run's full prefill)."""
    results = [r for r in json.loads((RESULTS / name).read_text())["results"] if r["dataset"] == "all"]
    full = next(r for r in results if r["mode"] == "full")
    return [
        {
            "mode": r["mode"], "setting": setting, "source": f"examples/results/{name}", "n": r["n"],
            "f1": round(r["f1"], 2), "f1_delta": _round(r["f1_delta"]),
            "f1_delta_ci95": [round(x, 2) for x in r["f1_delta_ci95"]] if r["f1_delta_ci95"] else None,
            "first_token_kl": round(r["first_token_kl"], 3), "identical_to_full_pct": round(100 * r["identical"], 1),
            "ttft_ms_median": round(r["ttft_ms_median"]),
            "speedup": round(full["ttft_ms_median"] / r["ttft_ms_median"], 1),
            "needs_trained_file": _needs_trained_file(r["mode"]),
        }
        for r in results
    ]  # fmt: skip


def choose(dev: list[Row], candidates: set[str]) -> tuple[str, str]:
    """The mode the rule picks among ``candidates`` (modes with a row in every dev setting), and why."""
    by_mode = {m: [r for r in dev if r["mode"] == m] for m in candidates}
    by_mode = {m: rs for m, rs in by_mode.items() if len(rs) == len(DEV) and m != "full"}
    fast_enough = {m: rs for m, rs in by_mode.items() if min(r["speedup"] for r in rs) >= MIN_SPEEDUP}
    within_noise = {m: rs for m, rs in fast_enough.items() if all(r["f1_delta_ci95"][1] >= 0 for r in rs)}
    if within_noise:
        best = max(within_noise, key=lambda m: statistics.mean(r["f1_delta"] for r in within_noise[m]))
        return best, f">= {MIN_SPEEDUP:g}x in both settings and F1 within noise of full prefill in both"
    best = min(fast_enough, key=lambda m: statistics.mean(r["first_token_kl"] for r in fast_enough[m]))
    return best, (
        f">= {MIN_SPEEDUP:g}x in both settings; none of those keeps F1 within noise in both, so the lowest mean "
        "first-token KL"
    )


def build() -> dict[str, Any]:
    dev = [row for setting, name in DEV.items() for row in rows_of(name, setting)]
    frontier = rows_of(FRONTIER, "closed, 30 questions")
    user = json.loads((RESULTS / USER_DOCS).read_text())
    modes = {r["mode"] for r in dev}
    chosen, why = choose(dev, modes)
    fallback, fallback_why = choose(dev, {m for m in modes if not _needs_trained_file(m)})
    return {
        "sources": {"dev": [f"examples/results/{n}" for n in DEV.values()],
                    "frontier": f"examples/results/{FRONTIER}", "user_docs": f"examples/results/{USER_DOCS}"},
        "rule": __doc__.split("\n\n")[2].replace("\n", " "),
        "chosen": {"with_adapter": chosen, "why": why, "without_adapter": fallback, "why_without": fallback_why},
        "rows": dev + frontier,
        "user_docs": {"n": len(user["questions"]), "k": user["config"]["k"], "counts": user["summary"]},
    }  # fmt: skip


def markdown(choice: dict[str, Any]) -> str:
    """The README's "Which mode to choose" table: one row per mode, the two dev settings side by side."""
    user = choice["user_docs"]["counts"]
    head = ("| mode | closed: ΔF1 vs full [95% CI] | KL | = full | speedup | open: ΔF1 vs full [95% CI] | KL | = full "
            "| speedup | user docs: right / = full |")  # fmt: skip
    lines = [head, "|" + "---|" * 10]
    dev = [r for r in choice["rows"] if r["setting"] in DEV]
    for mode in dict.fromkeys(r["mode"] for r in dev):
        cells = [f"`{mode}`" if mode != "full" else "full prefill"]
        for setting in DEV:
            r = next(r for r in dev if r["mode"] == mode and r["setting"] == setting)
            low, high = r["f1_delta_ci95"] or (0, 0)
            delta = "" if r["f1_delta"] is None else f"{r['f1_delta']:+.2f} [{low:+.2f}, {high:+.2f}]"
            cells += [delta, f"{r['first_token_kl']:.3f}", f"{r['identical_to_full_pct']:.1f}%", f"{r['speedup']:.1f}x"]
        counts = user.get(mode)
        cells.append(f"{counts['correct']} / {counts['identical_to_full']} of {counts['n']}" if counts else "")
        lines.append("| " + " | ".join(cells) + " |")
    head = "| mode | 30 questions, closed: ΔF1 vs full [95% CI] | KL | = full | speedup | user docs: right / = full |"
    lines += ["", head, "|" + "---|" * 6]
    for r in (r for r in choice["rows"] if r["setting"] not in DEV and r["mode"] in user):
        low, high = r["f1_delta_ci95"] or (0, 0)
        delta = "" if r["f1_delta"] is None else f"{r['f1_delta']:+.2f} [{low:+.2f}, {high:+.2f}]"
        counts = user[r["mode"]]
        cells = [f"`{r['mode']}`" if r["mode"] != "full" else "full prefill", delta, f"{r['first_token_kl']:.3f}",
                 f"{r['identical_to_full_pct']:.1f}%", f"{r['speedup']:.1f}x",
                 f"{counts['correct']} / {counts['identical_to_full']} of {counts['n']}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _needs_trained_file(mode: str) -> bool:
    if mode == "full":
        return False
    spec = resolve_mode(mode)
    return spec.adapter or spec.calibrated


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the choice and its table here")
    args = parser.parse_args()
    choice = build()
    print(markdown(choice))
    print(f"\ndefault: `{choice['chosen']['with_adapter']}` ({choice['chosen']['why']}); without a trained adapter: "
          f"`{choice['chosen']['without_adapter']}` ({choice['chosen']['why_without']})")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(choice, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
