"""How often drafts are kept by how sure the model was of the fed token: the draft policy's priors by confidence.

Where the model copies from the passages it is sure of each token it picks, and the next tokens of the copy (the
drafts) are then kept far more often than after an unsure pick. ``answer`` decodes the tuning split's questions
(HotpotQA 300-699, never evaluated) from their own passages, greedily and without speculation, in the default
mode and ``naive``, keeping each token's top softmax probability; ``fit`` replays prompt lookup (with the model's
stock phrases, every draft verified, as ``speculation_bound.py``) over those answers and reports, per bin of
``draft_policy.CONFIDENCE_BINS``, the share of first drafts kept and of drafts kept after a kept one. The stock
phrases were fitted on these same answers, so the priors count the steps that drafted from the request's own
tokens only (the phrase steps are reported apart):

    python examples/draft_confidence.py answer --start 0 --stop 20 --out /tmp/answers_0.jsonl
    python examples/draft_confidence.py fit --answers /tmp/answers_*.jsonl --json examples/results/draft_confidence.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from draft_policy_replay import replay

from pc_rag.eval.datasets import load_examples, tuning_split
from pc_rag.model import load_model
from pc_rag.rag import RagEngine
from pc_rag.rag.tuned import find_phrases
from pc_rag.runtime.answer_phrases import AnswerPhrases
from pc_rag.runtime.draft_policy import CONFIDENCE_BINS, confidence_bin

DATASET = Path("../shared/data/multidoc_qa/hotpotqa.jsonl")
MAX_NEW_TOKENS = 64
MAX_DRAFTS = 3


def answer(args: argparse.Namespace) -> None:
    engine = RagEngine(load_model(dtype=args.dtype))
    split = tuning_split(load_examples(args.dataset))[args.start : args.stop]
    with args.out.open("w", encoding="utf-8") as out:
        for example in split:
            texts = [engine.passage_text(i + 1, p.title, p.text) for i, p in enumerate(example.passages)]
            chunks = engine.encode(texts)
            prompt = [int(t) for t in engine.full_ids(chunks, example.question)]
            for mode in dict.fromkeys((engine.default_mode, "naive")):
                result = engine.answer(chunks, example.question, mode, max_new_tokens=MAX_NEW_TOKENS,
                                       speculative=False, keep_logits=MAX_NEW_TOKENS)  # fmt: skip
                ids = list(result.token_ids)
                rows = torch.stack(list(result.step_logits))[: len(ids)].float()
                top = rows.softmax(-1).max(-1).values.tolist()  # top[j]: how sure the pick of ids[j] was
                out.write(json.dumps({"index": example.index, "mode": mode, "prompt": prompt, "ids": ids,
                                      "top": top}) + "\n")  # fmt: skip
            print(example.index, flush=True)


def replay_steps(prompt: list[int], ids: list[int], top: list[float], phrases: AnswerPhrases | None) -> list[dict]:
    """Every verify step of prompt lookup over a greedy answer, every draft verified: source, confidence bin of
    the fed token, drafts and kept drafts."""
    steps: list[dict] = []

    def observe(features: dict, drafted: int, kept: int) -> None:
        steps.append({"source": features["source"], "bin": confidence_bin(features["confidence"]),
                      "drafted": drafted, "kept": kept})  # fmt: skip

    answer = {"prompt": prompt, "ids": ids, "top": top, "length": len(prompt)}
    replay(answer, [1.0] * (MAX_DRAFTS + 1), phrases, lambda drafts, _, __: len(drafts), observe)
    return steps


def fit(args: argparse.Namespace) -> None:
    engine = RagEngine(load_model(dtype=args.dtype))
    phrases_path = find_phrases(engine.lm)
    phrases = AnswerPhrases.load(phrases_path) if phrases_path is not None else None
    counts: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # first kept/tried, next kept/tried
    answers = 0
    for path in args.answers:
        for line in path.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            answers += 1
            for step in replay_steps(row["prompt"], row["ids"], row["top"], phrases):
                count = counts[step["source"], step["bin"]]
                count[0] += step["kept"] > 0
                count[1] += 1
                tried = min(step["kept"], step["drafted"] - 1)  # successors tried: each after a kept draft
                count[2] += tried if step["kept"] == step["drafted"] else max(tried - 1, 0)
                count[3] += tried
    edges = (0.0, *CONFIDENCE_BINS, 1.0)
    bins = []
    print("source    confidence    steps  first kept  successors  kept")
    for source in ("context", "phrases"):
        for b in range(len(CONFIDENCE_BINS) + 1):
            first_kept, tried, next_kept, next_tried = counts[source, b]
            row = {"source": source, "bin": b, "confidence": [edges[b], edges[b + 1]], "steps": tried,
                   "first_kept": first_kept / tried if tried else None, "successors": next_tried,
                   "successor_kept": next_kept / next_tried if next_tried else None}  # fmt: skip
            bins.append(row)
            share = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
            print(f"{source:8}  ({edges[b]:.2f}, {edges[b + 1]:.2f}]  {tried:5}  {share(row['first_kept']):>10}"
                  f"  {next_tried:10}  {share(row['successor_kept']):>4}")  # fmt: skip
    if args.json:
        report = {"dataset": "HotpotQA tuning split (300-699), own passages", "dtype": args.dtype,
                  "answers": answers, "phrases": str(phrases_path or ""), "max_drafts": MAX_DRAFTS,
                  "confidence_bins": list(CONFIDENCE_BINS), "bins": bins}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    answering = commands.add_parser("answer", help="greedy answers to tuning questions, with each pick's confidence")
    answering.add_argument("--start", type=int, default=0, help="first question of the tuning split (0-based)")
    answering.add_argument("--stop", type=int, default=20)
    answering.add_argument("--out", type=Path, required=True, help="JSON lines, one answer each")
    answering.add_argument("--dataset", type=Path, default=DATASET)
    fitting = commands.add_parser("fit", help="keep rates by the fed token's confidence over answer files")
    fitting.add_argument("--answers", type=Path, nargs="+", required=True)
    fitting.add_argument("--json", type=Path)
    for command in (answering, fitting):
        command.add_argument("--dtype", default="int4")
    args = parser.parse_args()
    answer(args) if args.command == "answer" else fit(args)


if __name__ == "__main__":
    main()
