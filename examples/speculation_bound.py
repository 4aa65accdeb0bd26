"""How far speculation from the prompt can go on the bench's answers: an oracle draft count against measured rows.

Greedy speculation leaves the output unchanged, so a bench run's plain answers say which drafts a step would keep.
For each answer of an ``answer_time`` JSON (``pc-rag bench peers --answers``), this replays prompt lookup
(``PromptLookup``, up to 3 drafts a step) over its prompt and answer and reports tokens per step two ways:

- every draft verified (what ``speculative=True`` does);
- an oracle that verifies exactly the drafts that will be kept, and none when none will be: the most any draft
  policy can get.

Greedy keeps the same drafts either way, so tokens per step are the same; the cost of a step of R rows against one
row comes from ``verify_step_rows`` at the nearest measured length. The oracle's speedup over plain decoding
(tokens over summed step costs) bounds the bench's "speculation / plain decode" from above, and tokens per step
bounds it for free rows:

    python examples/speculation_bound.py --answers examples/results/answer_time_int4_policy.json \
        --rows examples/results/verify_step_rows_xeon.json --json examples/results/speculation_bound_xeon.json

``--row-cost 0.05`` asks what cheaper rows would give (each row past the first 5% of a one-row step),
``--all-modes`` takes every plain mode's answers (the bench's gate is over both modes), and ``--phrases`` replays
the lookup with the model's stock phrases (``runtime/answer_phrases.py``, ``pc-rag tune-phrases``) as its second
source, as serving does where the model has them. ``--max-drafts 7`` asks what longer drafts than a step's 3 would
give (steps of more than 4 rows cost what the measured rows' slope extends to).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from draft_policy_replay import replay as replay_costs

from pc_rag.bench.answer_time import answer_workload
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.model import load_model
from pc_rag.rag import RagEngine
from pc_rag.runtime.answer_phrases import AnswerPhrases

MAX_DRAFTS = 3


def replay(
    prompt: list[int],
    answer: list[int],
    relative: list[float],
    phrases: AnswerPhrases | None = None,
    max_drafts: int = MAX_DRAFTS,
) -> dict[str, float]:
    """Tokens per step (the same for both: greedy keeps the same drafts), and the speedup over plain decoding with
    every draft verified and with the oracle's count, at the step costs ``relative`` (1 to ``max_drafts + 1``
    rows)."""
    if len(answer) < 2:
        return {"tokens_per_step": 1.0, "every_speedup": 1.0, "oracle_speedup": 1.0}
    work = {"prompt": prompt, "ids": answer, "length": len(prompt)}

    def every(drafts: list[int], _: dict, __: int) -> int:
        return len(drafts)

    def oracle(_: list[int], __: dict, kept: int) -> int:
        return kept

    return {
        "tokens_per_step": replay_costs(work, [1.0] * (max_drafts + 1), phrases, every, max_drafts=max_drafts),
        "every_speedup": replay_costs(work, relative, phrases, every, max_drafts=max_drafts),
        "oracle_speedup": replay_costs(work, relative, phrases, oracle, max_drafts=max_drafts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=Path, required=True, help="an answer_time JSON with token_ids")
    rows_cost = parser.add_mutually_exclusive_group(required=True)
    rows_cost.add_argument("--rows", type=Path, help="a verify_step_rows JSON (relative step costs)")
    rows_cost.add_argument("--row-cost", type=float, help="what if: each row past the first costs this share of one")
    parser.add_argument("--all-modes", action="store_true", help="every plain pc-rag mode's answers, not the default's")
    parser.add_argument("--phrases", type=Path, help="a stock-phrase table: the lookup's second source")
    parser.add_argument(
        "--max-drafts",
        type=int,
        default=MAX_DRAFTS,
        help="what if: drafts a step may verify (rows past the measured 4 extrapolated linearly)",
    )
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bench = json.loads(args.answers.read_text())
    if args.rows is not None:
        costs = {r["context_tokens"]: [r["relative"][str(n)] for n in range(1, 5)]
                 for r in json.loads(args.rows.read_text())["rows"]}  # fmt: skip
    else:
        costs = {0: [1 + args.row_cost * n for n in range(4)]}
    for measured in costs.values():
        step = (measured[-1] - measured[0]) / (len(measured) - 1)
        measured.extend(measured[-1] + step * n for n in range(1, args.max_drafts + 2 - len(measured)))
    engine = RagEngine(load_model(dtype=args.dtype))
    phrases = AnswerPhrases.load(args.phrases) if args.phrases is not None else None
    questions = {q.id: q for q in sample_questions()}
    plain = {f"pc-rag {mode}" for mode in ("fast", "naive")} if args.all_modes else {f"pc-rag {engine.default_mode}"}
    rows = []
    for row in bench["rows"]:
        if row["peer"] not in plain or row.get("busy", 0) or not row.get("token_ids"):
            continue
        target = min((1024, 4096, 8192), key=lambda t: abs(t - row["context_tokens"]))
        work = answer_workload(engine, questions[row["question"]], target)
        relative = costs[min(costs, key=lambda length: abs(length - row["context_tokens"]))]
        found = replay(work.ids, row["token_ids"], relative, phrases, args.max_drafts)
        rows.append({"length": target, "question": row["question"], "tokens": len(row["token_ids"]), **found})
        every, oracle = found["every_speedup"], found["oracle_speedup"]
        print(f"{target:>5} {row['question'][:8]} {len(row['token_ids']):>3} tokens: {found['tokens_per_step']:.2f} "
              f"tokens/step; every draft {every:.2f}x, oracle {oracle:.2f}x")  # fmt: skip
    summary = {
        "median_speedup_if_rows_were_free": statistics.median(r["tokens_per_step"] for r in rows),
        "median_oracle_speedup": statistics.median(r["oracle_speedup"] for r in rows),
        "median_every_draft_speedup": statistics.median(r["every_speedup"] for r in rows),
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        costs_from = str(args.rows) if args.rows is not None else f"each row past the first {args.row_cost}"
        report = {"answers": str(args.answers), "rows_costs": costs_from, "phrases": str(args.phrases or ""),
                  "max_drafts": args.max_drafts,
                  "summary": summary, "rows": rows}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
