"""How CacheGen's step should be spent across layers: first-token KL of a mode against its size, per allocation.

    HF_HUB_OFFLINE=1 python examples/codec_allocation.py --json examples/results/codec_allocation.json

Questions come from the tuning split only (HotpotQA 340-355 by default: past the passages the shipped
tables were fitted on), so the constants chosen from this (``pc_rag.tune.codec``) never see an evaluated
question. Each question's passages are encoded for ``--mode``; each allocation quantizes and dequantizes
them at each step (no entropy coding: the size is the ideal one, each lane's empirical entropy over all
the questions' symbols, so it compares allocations, not the coder; ``side_bytes_per_token`` adds what the
tokens kept exactly beyond the first, in float16, and the escapes cost) and the mode answers; KL is
KL(uncompressed || quantized) of the first token. Allocations: ``uniform`` (one step everywhere),
``probe`` (only the default mode's probe layers finer), ``probe+sixth:G`` (``probe`` with the steps of
sixth G of the layers doubled: the sensitivity scan), ``tuned`` (``pc_rag.tune.codec.allocation``) and
``tuned*keys:F`` / ``tuned*values:F`` / ``tuned*probe:F`` / ``tuned*probed:F`` (``tuned`` with the keys',
the values', the probe layers' or only the probe layer's values' steps times F).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from pc_rag.codec import CodecTables
from pc_rag.codec.quantize import dequantize, quantize
from pc_rag.eval.datasets import load_examples, tuning_split
from pc_rag.eval.metrics import first_token_kl
from pc_rag.kv import SpanKV
from pc_rag.model import load_model
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.modes import MODES
from pc_rag.rag.tuned import find_codec_tables
from pc_rag.tune.codec import PROBE_LAYERS_STEP, allocation

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "multidoc_qa" / "hotpotqa.jsonl"
DEFAULT_ALLOCATIONS = ["uniform", "probe", *(f"probe+sixth:{g}" for g in range(6)), "tuned"]


def named_allocation(name: str, layers: int) -> torch.Tensor:
    """The [2, L] step factors called ``name`` (see the module docstring)."""
    if name == "tuned":
        return allocation(layers)
    if name.startswith(("tuned*keys:", "tuned*values:", "tuned*probe:", "tuned*probed:")):
        part, factor = name.removeprefix("tuned*").split(":")
        out = allocation(layers)
        probe = MODES["default"].probe_layer
        if part == "probe":
            out[:, : probe + 1] *= float(factor)
        elif part == "probed":  # the one thing the deviation probe reads from the cache: its layer's values
            out[1, probe] *= float(factor)
        else:
            out[0 if part == "keys" else 1] *= float(factor)
        return out
    out = torch.ones(2, layers)
    if name == "uniform":
        return out
    out[:, : MODES["default"].probe_layer + 1] = PROBE_LAYERS_STEP
    if name.startswith("probe+sixth:"):
        sixth = int(name.split(":")[1])
        out[:, [i for i in range(layers) if i * 6 // layers == sixth]] *= 2
    elif name != "probe":
        raise SystemExit(f"unknown allocation {name!r}")
    return out


def ideal_bytes(symbols: list[torch.Tensor]) -> float:
    """Bytes of ``symbols`` [2, L, H, S, D] each at each lane's empirical entropy over all of them."""
    lanes = torch.cat([s.transpose(3, 4).reshape(-1, s.shape[3]) for s in symbols], dim=1).long() + 128
    bits = 0.0
    for lane in lanes:
        counts = torch.bincount(lane, minlength=256).double()
        counts = counts[counts > 0]
        bits += float(-(counts * (counts / counts.sum()).log2()).sum())
    return bits / 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", type=Path, default=DATA)
    parser.add_argument("--first", type=int, default=340, help="first question (its index in the file)")
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--mode", default="default")
    parser.add_argument("--steps", default="0.7,1.0", help="comma-separated level steps (x each head's RMS)")
    parser.add_argument("--allocations", default=",".join(DEFAULT_ALLOCATIONS))
    parser.add_argument("--tables", type=Path, default=None, help="CacheGen tables (default: the model's shipped ones)")
    parser.add_argument("--label", default=None, help="what the tables are, put on every row (default: their digest)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    lm = load_model()
    engine = RagEngine(lm, RagPrompt.longbench())
    tables = CodecTables.load(args.tables or find_codec_tables(lm.fingerprint()))
    base = tables.transform
    examples = [e for e in tuning_split(load_examples(args.dataset)) if e.index >= args.first][: args.questions]
    cases = []
    for e in examples:
        texts = [engine.passage_text(i + 1, p.title, p.text) for i, p in enumerate(e.passages)]
        chunks = engine.encode(texts, args.mode)
        reference = engine.answer(chunks, e.question, args.mode, max_new_tokens=1).first_logits
        cases.append((e.question, chunks, reference))
    layers, rows = base.rms.shape[1], []
    for name in args.allocations.split(","):
        weights = named_allocation(name, layers)
        transform = replace(base, allocation=weights)
        for step in (float(s) for s in args.steps.split(",")):
            kls, symbols, tokens, side = [], [], 0, 0
            for question, chunks, reference in cases:
                coded = []
                for c in chunks:
                    x = torch.stack([c.kv.keys, c.kv.values]).float()
                    q = quantize(x, transform, step, 127)
                    symbols.append(q.symbols)
                    tokens += x.shape[3]
                    side += (q.raw.numel() - 1) * x[:, :, :, 0].numel() * 2 + q.escapes.index.numel() * 6
                    y = dequantize(q, transform, step, x[:, :, :, q.raw].half())
                    coded.append(replace(c, kv=SpanKV(y[0], y[1], c.kv.positions)))
                logits = engine.answer(coded, question, args.mode, max_new_tokens=1).first_logits
                kls.append(first_token_kl(reference, logits))
            row = {"tables": args.label or tables.digest, "allocation": name, "step": step,
                   "ideal_bytes_per_token": ideal_bytes(symbols) / tokens, "side_bytes_per_token": side / tokens,
                   "kl": sum(kls) / len(kls),
                   "kl_max": max(kls), "questions": len(cases)}  # fmt: skip
            rows.append(row)
            print(f"{name:<16} step {step:<5} {row['ideal_bytes_per_token']:>7,.0f} B/token "
                  f"(+{row['side_bytes_per_token']:,.0f} exact and escapes)  KL {row['kl']:.4f}")  # fmt: skip
    if args.json:
        config = {
            "dataset": str(args.dataset),
            "first": args.first,
            "mode": args.mode,
            "factors": allocation(layers).tolist(),
            "tables": tables.digest,
        }
        args.json.write_text(json.dumps({"config": config, "rows": rows}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
