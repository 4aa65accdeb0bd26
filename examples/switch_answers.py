"""Whole answers, with and without speculation, under each value of a decoding switch (an environment variable).

Per value of ``--switch`` (each in a process of its own: a layer packs its weights once, a model finds its stock
phrases once) this times a verify step of 1 to 4 rows at 1K tokens (``verify_step_rows.step_times``), and the
answers of ``--modes`` (plain and with speculation, greedy, up to 64 tokens, the ``ask`` prompt) of
``--questions`` sample questions at each length, as ``pc-rag bench peers --answers`` does. Quantized layers on
ATen's fused kernels or on AMX (``PC_RAG_AMX``: ``pc_rag/runtime/csrc/amx_linear.cpp`` dequantizes a weight block
once for up to 16 rows, so a verify step's extra rows cost almost nothing, but one row pays its dequant):

    python examples/switch_answers.py --switch PC_RAG_AMX --variants 0,int8,all \
        --json examples/results/amx_answers_xeon.json

Drafts from the request's tokens alone or with the model's stock phrases too (``PC_RAG_ANSWER_PHRASES``,
``pc_rag/runtime/answer_phrases.py``), over both modes of the bench's gate:

    python examples/switch_answers.py --switch PC_RAG_ANSWER_PHRASES --variants 0,1 --modes default,naive \
        --json examples/results/phrases_answers_xeon.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def measure(lengths: list[int], questions: int, modes: list[str]) -> dict[str, object]:
    """This process's figures (under its own value of the switch)."""
    sys.path.insert(0, str(HERE))
    from verify_step_rows import first_step, step_times

    from pc_rag.bench.answer_time import answer_workload, engine_peers
    from pc_rag.hotpotqa_sample import sample_questions
    from pc_rag.model import load_model
    from pc_rag.rag import RagEngine

    engine = RagEngine(load_model(dtype="int4"))
    runner, token, position, cache = first_step(engine, 1024, "naive")
    step_ms = step_times(runner, token, position, cache, 25)
    peers, answers = engine_peers(engine), []
    modes = [engine.default_mode if mode == "default" else mode for mode in modes]
    for target in lengths:
        for question in sample_questions()[:questions]:
            work = answer_workload(engine, question, target)
            for mode in modes:
                answers.append(_answer(peers, mode, work, target))
    ratios = [a["speculation_tokens_per_s"] / a["plain_tokens_per_s"] for a in answers]

    return {
        "step_ms_1k": step_ms,
        "median_speculation_over_plain": statistics.median(ratios),
        "median_speculation_tokens_per_s": statistics.median(a["speculation_tokens_per_s"] for a in answers),
        "median_plain_tokens_per_s": statistics.median(a["plain_tokens_per_s"] for a in answers),
        "total_speculation_answer_ms": sum(a["speculation_answer_ms"] for a in answers),
        "all_same_as_plain": all(a["same_as_plain"] for a in answers),
        "answers": answers,
    }


def _answer(peers: dict, mode: str, work: object, target: int) -> dict[str, object]:
    from pc_rag.bench.answer_time import _measure

    plain = _measure(f"pc-rag {mode}", peers[f"pc-rag {mode}"][0], work, 1)  # type: ignore[arg-type]
    spec = _measure(f"pc-rag {mode} + speculation", peers[f"pc-rag {mode} + speculation"][0], work, 1)  # type: ignore[arg-type]
    return {
        "length": target, "question": work.question.id, "mode": mode, "tokens": plain.tokens,  # type: ignore[attr-defined]
        "plain_tokens_per_s": plain.decode_tokens_per_s, "speculation_tokens_per_s": spec.decode_tokens_per_s,
        "speculation_answer_ms": spec.answer_ms, "tokens_per_step": spec.tokens_per_step,
        "same_as_plain": plain.token_ids == spec.token_ids, "token_ids": plain.token_ids,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--switch", default="PC_RAG_AMX", help="the environment variable (default PC_RAG_AMX)")
    parser.add_argument("--variants", default="0,int8,all", help="its values, one process each")
    parser.add_argument("--modes", default="default", help="comma-separated modes (default: the default mode)")
    parser.add_argument("--tokens", default="1024,4096,8192")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths, modes = [int(t) for t in args.tokens.split(",")], args.modes.split(",")
    if args.child:
        print(json.dumps(measure(lengths, args.questions, modes)))
        return
    from pc_rag.bench.provenance import commit, machine

    rows = []
    for variant in args.variants.split(","):
        command = [sys.executable, __file__, "--child", "--tokens", args.tokens, "--questions", str(args.questions),
                   "--modes", args.modes]  # fmt: skip
        env = {**os.environ, args.switch: variant}
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
        row = {args.switch: variant, **json.loads(out.strip().splitlines()[-1])}
        if rows:  # the same greedy answers as the first value's, token for token
            row["answers_as_first"] = sum(
                a["token_ids"] == b["token_ids"] for a, b in zip(rows[0]["answers"], row["answers"], strict=True)
            )
        rows.append(row)
        steps = row["step_ms_1k"]
        print(f"{args.switch}={variant:>4}: 1K step " + " ".join(f"{n}r {ms:.2f}" for n, ms in steps.items())
              + f" ms | plain {row['median_plain_tokens_per_s']:.1f} tok/s, speculation "
              f"{row['median_speculation_tokens_per_s']:.1f} tok/s (median), speculation/plain "
              f"{row['median_speculation_over_plain']:.2f}, answers "
              f"{row['total_speculation_answer_ms']:.0f} ms in all, "
              f"= plain: {row['all_same_as_plain']}", flush=True)  # fmt: skip
    if args.json:
        report = {"machine": machine(), "commit": commit(), "threads": torch.get_num_threads(), "rows": rows}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
