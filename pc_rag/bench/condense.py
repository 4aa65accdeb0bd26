"""Retrieval of follow-up turns with and without condensing (``pc_rag.rag.condense``), on the bundled follow-ups
(``data/followups.jsonl``: two-turn conversations over the HotpotQA sample's passages, each naming the passages that
answer its last turn). Hit@k: a gold passage among the ``k`` retrieved. Only the embedder runs, no LLM.

``python -m pc_rag.bench.condense`` prints the table. This module knows nothing about KV or serving.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files

import numpy as np

from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.rag.condense import standalone_query
from pc_rag.store.embeddings import Embedder, SentenceTransformerEmbedder


@dataclass(frozen=True)
class FollowUp:
    turns: tuple[tuple[str, str], ...]  # (role, text), ending with the user's follow-up
    titles: frozenset[str]  # passages that answer it


def follow_ups() -> list[FollowUp]:
    text = files("pc_rag").joinpath("data/followups.jsonl").read_text(encoding="utf-8")
    out = []
    for line in text.splitlines():
        row = json.loads(line)
        roles = ["user", "assistant"] * len(row["turns"])
        out.append(FollowUp(tuple(zip(roles, row["turns"], strict=False)), frozenset(row["titles"])))
    return out


def hit_rates(embedder: Embedder, k: int = 5) -> dict[str, float]:
    """Hit@``k`` of the follow-ups' last turns searched alone (``none``) and condensed (``condense``)."""
    passages = {title: f"{title}\n{body}" for q in sample_questions() for title, body in q.passages}
    titles = list(passages)
    docs = np.asarray(embedder.embed_documents(list(passages.values())), dtype=np.float32)
    docs /= np.linalg.norm(docs, axis=1, keepdims=True)
    rates = {}
    for name, condense in (("none", False), ("condense", True)):
        hits = 0
        for case in follow_ups():
            query = np.asarray(embedder.embed_query(standalone_query(case.turns, condense=condense)))
            best = np.argsort(-(docs @ (query / np.linalg.norm(query))))[:k]
            hits += any(titles[i] in case.titles for i in best)
        rates[name] = hits / len(follow_ups())
    return rates


if __name__ == "__main__":
    for k in (1, 3, 5):
        rates = hit_rates(SentenceTransformerEmbedder(), k)
        print(f"hit@{k}: " + "  ".join(f"{name} {rate:.2f}" for name, rate in rates.items()))
