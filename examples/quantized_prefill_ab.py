"""Prefill of an int4 model where the CPU has no bfloat16 arithmetic: the dense GEMMs in bfloat16 (oneDNN's
emulation, before) against the same GEMMs in float32 rounded once to bfloat16 (``weights.dense_linear``, now).

int8/int4 layers multiply many rows (prefill, recompute, encoding) by a dense bfloat16 copy of their weight. On a
CPU without AVX-512 BF16 or AMX, oneDNN emulates that GEMM at about a third of float32's speed. Both sides run in
one process on one model, alternating, on the bundled sample's passages cut to each length; the float32 model's
prefill is the reference row. Each cell is the median of ``--runs``.

    python examples/quantized_prefill_ab.py --json examples/results/quantized_prefill_ab_xeon.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pc_rag import weights
from pc_rag.assemble import forward_new_tokens
from pc_rag.bench.provenance import commit, machine
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.kv import allocate
from pc_rag.model import LoadedModel, load_model


def sample_ids(lm: LoadedModel, count: int) -> list[int]:
    """``count`` token ids of the bundled sample's passages, in order."""
    text = "\n".join(f"{title}: {body}" for q in sample_questions() for title, body in q.passages)
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= count, f"the sample has {len(ids)} tokens, fewer than {count}"
    return ids[:count]


@torch.inference_mode()
def prefill(lm: LoadedModel, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Seconds of one forward of ``ids`` into an empty buffer, and its last logits."""
    buffer = allocate(lm.model, len(ids))
    start = time.perf_counter()
    logits, _ = forward_new_tokens(lm.model, buffer, 0, ids, range(len(ids)))
    return time.perf_counter() - start, logits.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-context", default="1024,4096")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    native = weights.NATIVE_BFLOAT16
    int4, dense = load_model(dtype="int4"), load_model(dtype="float32")
    rows = []
    for count in (int(t) for t in args.tokens_context.split(",")):
        ids = sample_ids(int4, count)
        prefill(int4, ids[:64])  # first-call costs
        times: dict[str, list[float]] = {"bfloat16_gemm": [], "float32_gemm": [], "float32_model": []}
        logits = {}
        for _ in range(args.runs):
            for side, flag in (("bfloat16_gemm", True), ("float32_gemm", False)):
                weights.NATIVE_BFLOAT16 = flag
                seconds, logits[side] = prefill(int4, ids)
                times[side].append(seconds)
            weights.NATIVE_BFLOAT16 = native
            times["float32_model"].append(prefill(dense, ids)[0])
        row: dict[str, object] = {f"{side}_s": statistics.median(t) for side, t in times.items()}
        row |= {
            "context_tokens": count, "threads": torch.get_num_threads(), "native_bfloat16": native,
            "speedup": row["bfloat16_gemm_s"] / row["float32_gemm_s"],  # type: ignore[operator]
            "max_abs_logit_difference": (logits["bfloat16_gemm"] - logits["float32_gemm"]).abs().max().item(),
            "same_next_token": bool(logits["bfloat16_gemm"].argmax() == logits["float32_gemm"].argmax()),
        }  # fmt: skip
        print(f"{count:>6} tokens: int4 prefill with bfloat16 GEMMs {row['bfloat16_gemm_s']:.2f} s, float32 GEMMs "
              f"{row['float32_gemm_s']:.2f} s ({row['speedup']:.2f}x); float32 model {row['float32_model_s']:.2f} s; "
              f"max |logit difference| {row['max_abs_logit_difference']:.2f}")  # fmt: skip
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "commit": commit(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
