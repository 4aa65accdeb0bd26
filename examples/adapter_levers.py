"""Train splice adapters with different levers, evaluate each as ``fast`` on the same questions, and collect one JSON.

    python examples/adapter_levers.py train --only NAME [--threads 1]     # one lever's `pc-rag tune` (resumable)
    python examples/adapter_levers.py eval --only NAME [--threads 2]      # its `pc-rag eval --adapter` (resumable)
    python examples/adapter_levers.py collect --json examples/results/adapter_levers30.json

Every lever trains on the closed HotpotQA tuning pairs (``--questions`` of them; validation: the split's last 50)
with the teacher set in ``--work``, and is evaluated on the 30-question closed subset the frontier uses (the first
10 evaluated questions of HotpotQA, 2WikiMultihopQA and MuSiQue), modes ``full,fast``. ``store`` levers train
with ``pc-rag tune --store`` on a store of dev passages instead (no labels). The collected JSON holds, per lever,
its command, training cost and validation KL, and its eval rows; ``examples/results_table.py`` renders it.
Training commands run at 1 thread by default so two can share the machine; evaluation times TTFT, so run it alone
on an idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "multidoc_qa"
SHIPPED = ROOT / "pc_rag" / "data" / "tuned"

# name -> (model, extra `pc-rag tune` arguments); "{shipped}" is the model's shipped adapter
LEVERS: dict[str, tuple[str, list[str]]] = {
    "query-r8": ("smollm2-135m-instruct", ["--rank", "8", "--alpha", "16", "--lr", "2e-3"]),
    "query-r16-all": ("smollm2-135m-instruct", ["--rank", "16", "--alpha", "32", "--lr", "1e-3", "--targets",
                                      "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]),
    "shipped+query": ("smollm2-135m-instruct", ["--init", "{shipped}", "--lr", "1e-3", "--epochs", "1"]),
    "shipped+encoding": ("smollm2-135m-instruct", ["--init", "{shipped}", "--encoding", "separate", "--lr", "1e-3",
                                         "--epochs", "1"]),
    "store-query-r8": ("smollm2-135m-instruct", ["--rank", "8", "--alpha", "16", "--lr", "2e-3"]),
    "gemma-query-r8": ("gemma3-270m", ["--rank", "8", "--alpha", "16", "--lr", "2e-3", "--questions", "100"]),
}  # fmt: skip
SHIPPED_LEVER = "shipped"  # the adapter pc-rag ships, evaluated as is
MODELS = {name: model for name, (model, _) in LEVERS.items()}


def _paths(name: str, out: Path) -> tuple[Path, Path, Path]:
    return out / f"{name}.safetensors", out / f"{name}.eval.json", out / f"{name}.eval.partial.jsonl"


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}


def _model_fingerprint(model: str) -> str:
    from pc_rag.model import load_model

    return load_model(model).fingerprint()


def train(name: str, args: argparse.Namespace) -> None:
    model, extra = LEVERS[name]
    adapter, _, _ = _paths(name, args.out)
    extra = [a.replace("{shipped}", str(SHIPPED / f"{_model_fingerprint(model)}.safetensors")) for a in extra]
    common = ["--epochs", "4", *extra, "--eval-every", str(args.eval_every), "--patience", "2"]
    if name.startswith("store-"):
        work = args.work / f"{name}-work"
        data = ["--store", str(args.store), "--pairs", str(args.questions + args.questions // 3)]
    else:
        work = args.work / model
        data = ["--dataset", str(DATA / "hotpotqa.jsonl"), "--variants", "closed"]
        data += [] if "--questions" in extra else ["--questions", str(args.questions)]
    command = ["pc-rag", "-v", "--model", model, "tune", *data, "--work", str(work), "--out", str(adapter), *common]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True, env=_env(args.threads))


def evaluate(name: str, args: argparse.Namespace) -> None:
    model = LEVERS[name][0] if name in LEVERS else "smollm2-135m-instruct"
    adapter, result, state = _paths(name, args.out)
    if name == SHIPPED_LEVER:
        adapter = SHIPPED / f"{_model_fingerprint(model)}.safetensors"
    datasets = [a for n in ("hotpotqa", "2wikimqa", "musique") for a in ("--dataset", str(DATA / f"{n}.jsonl"))]
    command = ["pc-rag", "--model", model, "eval", *datasets, "--limit", str(args.limit), "--modes", "full,fast",
               "--setting", args.setting, "--adapter", str(adapter), "--json", str(result),
               "--state", str(state)]  # fmt: skip
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True, env=_env(args.threads))


def collect(args: argparse.Namespace) -> None:
    levers = []
    for name in [SHIPPED_LEVER, *LEVERS]:
        adapter, result, _ = _paths(name, args.out)
        report = adapter.with_suffix(".json")
        trained = json.loads(report.read_text()) if report.is_file() and name != SHIPPED_LEVER else None
        if not result.is_file() and trained is None:
            continue
        levers.append({
            "lever": name,
            "tune_arguments": LEVERS[name][1] if name in LEVERS else None,
            "training": None if trained is None else {
                "adapter_config": trained["adapter_config"], "train_config": trained["train_config"],
                "train_pairs": trained["train_pairs"], "val_pairs": trained["val_pairs"],
                "init": trained.get("init"), "cost": trained.get("cost"), "threads": args.threads,
                "val_baseline": trained["history"][0], "val_best": trained["best"], "val_last": trained["history"][-1],
                "val_history": trained["history"],
            },
            "eval": json.loads(result.read_text()) if result.is_file() else None,
        })  # fmt: skip
    args.json.write_text(json.dumps({"levers": levers}, indent=1) + "\n", encoding="utf-8")
    print(f"{len(levers)} levers -> {args.json}")


GATES = {"first_token_kl": 0.05, "first_token_agreement": 0.90, "teacher_forced_kl": 0.05, "identical": 0.40}


def markdown(data: dict) -> str:
    """One row per lever: training cost, validation KL (start -> best) and ``fast`` over every evaluated
    question against full prefill in the same run, with the issue's gates marked. No speed: levers run while
    others train, and every lever serves ``fast`` at the same cost (a merged adapter, no recompute); speed comes
    from one timed run on an idle machine."""
    head = ["lever", "model", "trained", "val KL first / 8-token: start -> last (kept)", "first-token KL",
            "first token = full",
            "8-token KL", "answer = full", "ΔF1 vs full [95% CI]"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lever in data["levers"]:
        t = lever["training"]
        if t is None:
            trained = "shipped"
            val = ""
        else:
            cost = t["cost"] or {}
            steps = cost.get("train_pair_steps", cost.get("train_count"))  # tune --dataset / tune --store reports
            trained = f"{t['train_pairs']} pairs, {steps} steps, {cost.get('train_s', float('nan')) / 60:.0f} min"
            start, last, kept = t["val_baseline"], t["val_last"], t["val_best"]
            which = "the start" if kept == start else "last" if kept == last else "best"
            val = (f"{start['first_kl']:.3f} / {start['mean_kl']:.3f} -> {last['first_kl']:.3f} / "
                   f"{last['mean_kl']:.3f} ({which})")  # fmt: skip
        model = lever["eval"]["config"]["model"] if lever["eval"] else MODELS.get(lever["lever"], "")
        if lever["eval"] is None:
            lines.append("| " + " | ".join([f"`{lever['lever']}`", model, trained, val, *[""] * 5]) + " |")
            continue
        fast = next(r for r in lever["eval"]["results"] if r["dataset"] == "all" and r["mode"] == "fast")

        low, high = fast["f1_delta_ci95"]
        cells = [
            f"`{lever['lever']}`", model, trained, val,
            _gate(fast, "first_token_kl", f"{fast['first_token_kl']:.3f}"),
            _gate(fast, "first_token_agreement", f"{100 * fast['first_token_agreement']:.1f}%"),
            _gate(fast, "teacher_forced_kl", f"{fast['teacher_forced_kl']:.3f}"),
            _gate(fast, "identical", f"{100 * fast['identical']:.1f}%"),
            f"{fast['f1_delta']:+.2f} [{low:+.2f}, {high:+.2f}] {'✓' if low >= -1.0 else '✗'}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _gate(row: dict, key: str, text: str) -> str:
    """``text`` marked with whether ``row[key]`` meets the issue's gate for it (KL at most, shares at least)."""
    ok = row[key] <= GATES[key] if "kl" in key else row[key] >= GATES[key]
    return f"{text} {'✓' if ok else '✗'}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["train", "eval", "collect"])
    parser.add_argument("--only", default=None, help="lever name (train, eval)")
    parser.add_argument("--out", type=Path, default=Path("/work/adapters"), help="adapters and eval results")
    parser.add_argument(
        "--work",
        type=Path,
        default=Path("/work/tw-levers"),
        help="teacher sets and stores: <work>/<model> for dataset levers",
    )
    parser.add_argument("--store", type=Path, default=None, help="store levers: the store of dev passages")
    parser.add_argument("--questions", type=int, default=150, help="training questions (pairs)")
    parser.add_argument("--eval-every", type=int, default=150)
    parser.add_argument("--limit", type=int, default=10, help="eval: questions per dataset")
    parser.add_argument("--setting", default="closed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="collect: where to write")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.action == "collect":
        if args.json is None:
            parser.error("collect needs --json")
        collect(args)
    elif args.only is None:
        parser.error(f"{args.action} needs --only NAME ({', '.join([SHIPPED_LEVER, *LEVERS])})")
    elif args.action == "train":
        train(args.only, args)
    else:
        evaluate(args.only, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
