"""The ceiling of token selection (issue 12, lever 4): recompute budgets chosen by oracles that see full prefill.

A server cannot know, before computing, which chunk tokens full prefill would have
changed or which the question attends to over the true context. This research script
computes both from full prefill's own KV and asks how low first-token and 8-token
teacher-forced KL(full || mode) go when a budget of chunk tokens is chosen by

- ``attention``: the question's attention to each chunk token in full prefill, all layers;
- ``deviation``: the change of each token's values from spliced to full prefill, all layers;
- ``weighted``: the two together, sum over layers of attention x value change (the first-order
  error a stale token adds to the question's attention output);

and, for comparison on the same questions, what serving chooses without an oracle (``query``,
the question's attention over the stale cache in the first 2 layers). Closed contexts, the
first ``--limit`` evaluable questions of each dataset, greedy. It prints a table and writes JSON.

    python examples/oracle_sweep.py --dataset hotpotqa.jsonl --dataset 2wikimqa.jsonl \
        --dataset musique.jsonl --limit 10 --json examples/results/oracle30.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm
from transformers.cache_utils import Cache

from pc_rag.assemble import forward_new_tokens
from pc_rag.eval.contexts import ClosedContexts
from pc_rag.eval.datasets import load_examples
from pc_rag.eval.metrics import TEACHER_FORCED_STEPS, first_token_kl, teacher_forced, teacher_forced_steps
from pc_rag.kv import PreallocatedLayer, allocate
from pc_rag.model import load_model
from pc_rag.probe import KWARG as PROBE
from pc_rag.probe import AttentionProbe
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.engine import chunk_slots, splice_chunks
from pc_rag.rag.modes import MODES
from pc_rag.rag.query_select import query_indices
from pc_rag.runtime.model_call import with_cache

SCORERS = ("attention", "deviation", "weighted")


class LayerProbe(AttentionProbe):
    """An attention probe that keeps each layer's scores [L, cached] and lets the forward run to the end."""

    def __init__(self, cached: int, layers: int) -> None:
        super().__init__(cached, layers + 1)  # never reaches its stop layer
        self.per_layer: list[torch.Tensor] = []

    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float, window: int | None = None):
        before = self.scores
        super().add(layer, query, key, scaling, window)
        self.per_layer.append(self.scores if before is None else self.scores - before)


class ForcedSelection(RagEngine):
    """The engine, recomputing exactly ``self.forced`` (cache indices) when set, else what the mode chooses."""

    forced: list[int] | None = None

    def _select(self, *args, **kwargs) -> list[int]:
        return super()._select(*args, **kwargs) if self.forced is None else list(self.forced)


@torch.inference_mode()
def oracle_scores(engine: RagEngine, chunks, question: str) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
    """Each scorer's per-cache-entry score [total] and the chunks' (start, length) slots."""
    model, head = engine.lm.model, len(engine.head_ids)
    slots, total = chunk_slots(head, chunks)
    tail = engine.tokenize(engine.prompt.tail(engine.wrappers, question))
    fresh, stale = allocate(model, total + len(tail)), allocate(model, total + len(tail))
    forward_new_tokens(model, fresh, 0, engine.full_ids(chunks, question)[:total], range(total))
    splice_chunks(stale, engine.lm.rope, engine.head_kv, chunks, slots)
    layers = fresh.keys.shape[0]
    probe = LayerProbe(total, layers)
    cache = Cache(layers=[PreallocatedLayer(fresh.keys[i], fresh.values[i], total) for i in range(layers)])
    positions = list(range(total, total + len(tail)))
    model.get_decoder()(
        input_ids=torch.tensor([list(tail)]),
        position_ids=torch.tensor([positions]),
        **with_cache(cache),
        use_cache=True,
        **{PROBE: probe},
    )
    attention = torch.stack(probe.per_layer)  # [L, total]
    change = (fresh.values[:, 0, :, :total] - stale.values[:, 0, :, :total]).norm(dim=-1).sum(1)  # [L, total]
    return {
        "attention": attention.sum(0),
        "deviation": change.sum(0),
        "weighted": (attention * change).sum(0),
    }, slots


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", action="append", required=True)
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--budgets", default="0.05,0.1,0.15,0.2,0.25")
    parser.add_argument("--adapter-budgets", default="0.05,0.1,0.2", help="weighted oracle with the splice adapter")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    adapter_budgets = [float(b) for b in args.adapter_budgets.split(",") if b]

    lm = load_model()
    engine = ForcedSelection(lm, RagPrompt.longbench())
    contexts = ClosedContexts(engine)
    examples = [e for path in args.dataset for e in load_examples(path, args.limit, skip_tuning_split=True)]
    configs = [(s, b, False) for s in (*SCORERS, "query") for b in budgets]
    configs += [("weighted", b, True) for b in adapter_budgets]
    rows: dict[tuple[str, float, bool], list[tuple[float, float]]] = {c: [] for c in configs}
    for example in tqdm(examples, desc="oracle", unit="q"):
        chunks = contexts.chunks(example, "prefix")
        full = engine.answer_full(chunks, example.question, max_new_tokens=TEACHER_FORCED_STEPS, keep_logits=8)
        reference = full.token_ids[: teacher_forced_steps(full) - 1]
        scores, slots = oracle_scores(engine, chunks, example.question)
        for scorer, budget, adapted in configs:
            if scorer == "query":  # what serving chooses, for comparison
                engine.forced, mode = None, replace(MODES["query"], ratio=budget, window=0)
            else:
                engine.forced = query_indices(scores[scorer], slots, budget)
                mode = replace(MODES["prefix"], name=f"{scorer}:{budget}", adapter=adapted)
            result = engine.answer(chunks, example.question, mode, reference_ids=reference, max_new_tokens=1)
            forced = teacher_forced(full, result)
            rows[(scorer, budget, adapted)].append((first_token_kl(full.first_logits, result.first_logits), forced[0]))
    table = [
        {
            "selection": scorer,
            "budget": budget,
            "adapter": adapted,
            "n": len(values),
            "first_token_kl": statistics.fmean(v[0] for v in values),
            "teacher_forced_kl": statistics.fmean(v[1] for v in values),
        }
        for (scorer, budget, adapted), values in rows.items()
    ]
    print(f"{'selection':<12}{'budget':>8}{'adapter':>9}{'KL':>8}{'8-tok KL':>10}")
    for row in table:
        print(
            f"{row['selection']:<12}{row['budget']:>8.2f}{row['adapter']!s:>9}"
            f"{row['first_token_kl']:>8.3f}{row['teacher_forced_kl']:>10.3f}"
        )
    args.json.write_text(json.dumps({"questions": len(examples), "rows": table}, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
