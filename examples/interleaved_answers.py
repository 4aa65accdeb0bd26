"""Speculation over plain decoding under each value of a switch read per request, the values interleaved.

``switch_answers.py`` runs each value in a process of its own, one after the other; on a VM whose speed drifts
(a one-row step at 1K took 10.5 ms in one process and 12.3 ms in the next) that drift is as large as what a draft
policy changes. A switch that is read per request (``PC_RAG_DRAFT_CONFIDENCE``, read when a request's draft policy
is made) can instead be compared within one process: for each sample answer of the bench (``ask`` prompt, greedy,
up to 64 tokens, each question at each length, both modes), ``--repeats`` rounds each run plain decoding and
speculation under every value, in an order that rotates every round; an answer's tokens/s is its median over the
rounds, and its ratio is that of speculation over plain decoding of the same rounds:

    python examples/interleaved_answers.py --switch PC_RAG_DRAFT_CONFIDENCE --variants 0,1 --repeats 3 \
        --json examples/results/draft_confidence_interleaved_zen4.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from pc_rag.bench.answer_time import _measure, answer_workload, engine_peers
from pc_rag.bench.provenance import commit, machine
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.model import load_model
from pc_rag.rag import RagEngine


def interleaved(peers: dict, mode: str, work: object, switch: str, variants: list[str], repeats: int) -> dict:
    """One answer's plain and speculative decode speeds (medians over ``repeats`` rounds, each round running plain
    decoding and every value of ``switch`` in an order that rotates), and whether every output equals plain's."""
    arms = ["plain", *variants]
    speeds: dict[str, list[float]] = {arm: [] for arm in arms}
    outputs: dict[str, list[list[int]]] = {arm: [] for arm in arms}
    steps: dict[str, float] = {}
    for round_ in range(repeats):
        for arm in arms[round_ % len(arms) :] + arms[: round_ % len(arms)]:
            name = f"pc-rag {mode}" if arm == "plain" else f"pc-rag {mode} + speculation"
            if arm != "plain":
                os.environ[switch] = arm
            measured = _measure(name, peers[name][0], work, 1)
            speeds[arm].append(measured.decode_tokens_per_s)
            outputs[arm].append(measured.token_ids)
            if arm != "plain":
                steps[arm] = measured.tokens_per_step
    plain_ids = outputs["plain"][0]
    plain = statistics.median(speeds["plain"])
    return {"tokens": len(plain_ids), "plain_tokens_per_s": plain,
            "same_as_plain": all(ids == plain_ids for v in variants for ids in outputs[v]),
            "variants": {v: {"tokens_per_s": statistics.median(speeds[v]),
                             "over_plain": statistics.median(speeds[v]) / plain,
                             "tokens_per_step": steps[v]} for v in variants}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switch", required=True, help="an environment variable read per request")
    parser.add_argument("--variants", default="0,1", help="its values, interleaved")
    parser.add_argument("--modes", default="default,naive")
    parser.add_argument("--tokens", default="1024,4096,8192")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    variants = args.variants.split(",")
    engine = RagEngine(load_model(dtype="int4"))
    peers = engine_peers(engine)
    modes = [engine.default_mode if mode == "default" else mode for mode in args.modes.split(",")]
    answers = []
    for target in (int(t) for t in args.tokens.split(",")):
        for question in sample_questions()[: args.questions]:
            work = answer_workload(engine, question, target)
            for mode in modes:
                row = {"length": target, "question": question.id, "mode": mode,
                       **interleaved(peers, mode, work, args.switch, variants, args.repeats)}  # fmt: skip
                answers.append(row)
                print(f"{target:>5} {question.id[:8]} {mode:5} {row['tokens']:>3} tokens: plain "
                      f"{row['plain_tokens_per_s']:6.1f} tok/s; "
                      + "; ".join(f"{args.switch}={v} {row['variants'][v]['over_plain']:.2f}x" for v in variants),
                      flush=True)  # fmt: skip
    summary = {v: {"median_over_plain": statistics.median(a["variants"][v]["over_plain"] for a in answers)}
               for v in variants}  # fmt: skip
    print(json.dumps(summary, indent=1))
    if args.json:
        same = all(a["same_as_plain"] for a in answers)
        report = {"machine": machine(), "commit": commit(), "threads": torch.get_num_threads(), "switch": args.switch,
                  "repeats": args.repeats, "summary": summary, "all_same_as_plain": same,
                  "answers": answers}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
