"""The draft policy replayed over the bench's answers at measured row costs: with and without confidence bins.

A policy changes which drafts a step verifies, never the greedy output, so it can be measured without timing noise:
decode each sample question's answer (the bench's workload: ``ask`` prompt padded to each length, both modes,
greedy, up to 64 tokens, no speculation) keeping each token's top softmax probability, then replay prompt lookup
(with the model's stock phrases) and ``DraftPolicy`` itself over the answer, as ``generate.decode_tokens`` calls
them, each step costing its rows' share of a one-row step from a ``verify_step_rows`` JSON (the policy's
``StepCosts`` are given those costs). The policy's keep rates pool over the answers in order, as a server's runner
pools them over requests. Per answer: decoded tokens over summed step costs, the speedup over plain decoding at
those costs; every draft verified and an oracle (only the drafts that will be kept) for reference:

    python examples/verify_step_rows.py --tokens-context 1024,4096,8192 --json /tmp/rows.json
    python examples/draft_policy_replay.py --rows /tmp/rows.json --questions 12:20 \
        --json examples/results/draft_policy_replay_zen4.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from pc_rag.bench.answer_time import answer_workload
from pc_rag.bench.provenance import commit, machine
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.model import load_model
from pc_rag.rag import RagEngine
from pc_rag.rag.tuned import find_phrases
from pc_rag.runtime.answer_phrases import AnswerPhrases
from pc_rag.runtime.decode_step import STEP_ROWS
from pc_rag.runtime.draft_policy import DraftPolicy, KeepRates, StepCosts
from pc_rag.runtime.speculation import PromptLookup

MAX_TOKENS = 64
LENGTHS = (1024, 4096, 8192)

Choose = Callable[[list[int], dict, int], int]


def answers(engine: RagEngine, first: int, stop: int) -> list[dict]:
    """Greedy answers (no speculation) of sample questions first..stop-1 at each length in both modes, with each
    token's top probability (``top[j]``: how sure the pick of ``ids[j]`` was)."""
    out = []
    for index in range(first, stop):
        question = sample_questions()[index]
        for target in LENGTHS:
            work = answer_workload(engine, question, target)
            for mode in dict.fromkeys((engine.default_mode, "naive")):
                result = engine.answer(work.chunks, question.question, mode, max_new_tokens=MAX_TOKENS,
                                       speculative=False, keep_logits=MAX_TOKENS)  # fmt: skip
                ids = list(result.token_ids)
                top = torch.stack(list(result.step_logits))[: len(ids)].float().softmax(-1).max(-1).values.tolist()
                out.append({"question": question.id, "length": target, "mode": mode, "prompt": list(map(int, work.ids)),
                            "ids": ids, "top": top})  # fmt: skip
                print(f"{target:>5} {question.id[:8]} {mode:5} {len(ids):>3} tokens", flush=True)
    return out


def replay(
    answer: dict,
    relative: list[float],
    phrases: AnswerPhrases | None,
    choose: Choose,
    observe: Callable[[dict, int, int], None] | None = None,
    max_drafts: int = STEP_ROWS - 1,
) -> float:
    """Decoded tokens over summed step costs when ``choose(drafts, features, kept)`` picks each step's count (up to
    ``max_drafts`` drafts a step; ``relative[r]``: a step of r + 1 rows). ``answer`` holds the prompt's and the
    answer's ids, the answer's length bucket and, where measured, each pick's top probability (``top``)."""
    ids, top = answer["ids"], answer.get("top")
    lookup = PromptLookup(answer["prompt"], phrases=phrases)
    lookup.append(ids[0])  # the first token comes from the prefill
    at, cost = 1, 0.0
    while at < len(ids):
        drafts = lookup.propose(min(max_drafts, len(ids) - at - 1))
        would_keep = 0
        for offset, draft in enumerate(drafts):
            if ids[at + offset] != draft:
                break
            would_keep += 1
        features = {"matched": lookup.matched, "agreed": lookup.agreed, "source": lookup.source,
                    "confidence": top[at - 1] if top else None, "length": answer["length"]}  # fmt: skip
        count = choose(drafts, features, would_keep) if drafts else 0
        kept = min(count, would_keep)
        cost += relative[count]
        if observe is not None and count:
            observe(features, count, kept)
        for token in ids[at : at + kept + 1]:
            lookup.append(token)
        at += kept + 1
    decoded = len(ids) - 1
    return decoded / cost if decoded else 1.0


def policy_calls(policy: DraftPolicy, by_confidence: bool) -> tuple[Choose, Callable[[dict, int, int], None]]:
    """``replay``'s choose and observe through ``policy``, as ``generate.decode_tokens`` calls it."""

    def confidence(features: dict) -> float | None:
        return features["confidence"] if by_confidence else None

    def choose(drafts: list[int], f: dict, _: int) -> int:
        return policy.count(f["matched"], len(drafts), f["length"], f["agreed"], f["source"], confidence(f))

    def observe(f: dict, count: int, kept: int) -> None:
        policy.observe(f["matched"], count, kept, f["agreed"], f["source"], confidence(f))

    return choose, observe


def policy_speedups(rows: list[dict], costs: dict[int, list[float]], phrases: AnswerPhrases | None,
                    by_confidence: bool) -> list[float]:  # fmt: skip
    """``DraftPolicy`` over every answer in order, its keep rates pooled over them."""
    pooled, speedups = KeepRates(), []
    for answer in rows:
        step_costs = StepCosts()
        for length, shares in costs.items():
            for count, share in enumerate(shares):
                step_costs.record(count + 1, length, 10.0 * share)
        choose, observe = policy_calls(DraftPolicy(step_costs, pooled), by_confidence)
        speedups.append(replay(answer, costs[answer["length"]], phrases, choose, observe))
    return speedups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=Path, required=True, help="a verify_step_rows JSON (relative step costs)")
    parser.add_argument("--questions", default="0:4", help="sample questions FIRST:STOP (default the bench's 0:4)")
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    measured = {r["context_tokens"]: [r["relative"][str(n)] for n in range(1, STEP_ROWS + 1)]
                for r in json.loads(args.rows.read_text())["rows"]}  # fmt: skip
    costs = {length: measured[min(measured, key=lambda m: abs(m - length))] for length in LENGTHS}
    engine = RagEngine(load_model(dtype=args.dtype))
    phrases_path = find_phrases(engine.lm)
    phrases = AnswerPhrases.load(phrases_path) if phrases_path is not None else None
    first, stop = (int(x) for x in args.questions.split(":"))
    rows = answers(engine, first, stop)
    results = {
        "every draft": [replay(a, costs[a["length"]], phrases, lambda d, f, k: len(d)) for a in rows],
        "oracle": [replay(a, costs[a["length"]], phrases, lambda d, f, k: k) for a in rows],
        "policy": policy_speedups(rows, costs, phrases, by_confidence=False),
        "policy with confidence bins": policy_speedups(rows, costs, phrases, by_confidence=True),
    }
    summary = {name: {"median": statistics.median(s), "mean": statistics.mean(s)} for name, s in results.items()}
    for name, figures in summary.items():
        print(f"{name:<28} speedup over plain at these row costs: median {figures['median']:.3f}, "
              f"mean {figures['mean']:.3f} ({len(rows)} answers)")  # fmt: skip
    if args.json:
        report = {"machine": machine(), "commit": commit(), "rows_costs": costs, "phrases": str(phrases_path or ""),
                  "summary": summary, "speedups": results,
                  "answers": [{k: a[k] for k in ("question", "length", "mode", "ids")} for a in rows]}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
