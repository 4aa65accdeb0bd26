"""Training contexts for the splice adapter: (chunks, question) pairs drawn from the tuning split.

Every example of the tuning split gives several pairs, one per *variant*, so the adapter sees
the layouts serving meets: ``closed`` (its own passages, numbered in order, as LongBench and
the closed eval lay them out), ``closed-shuffled`` (the same chunks in a seeded order: the
numbers travel with their passages, so no chunk is encoded twice), ``open`` (the top ``k``
passages retrieved from every passage of the split pooled in one store, best first, as the
open eval does) and ``open-best-last`` (the same, reversed). Chunk KV lives in two document
stores under one directory (numbered passages; pooled passages), built on first use in saved
parts so an interrupted build resumes. Examples from ``val_from`` on form the validation split:
their passages and questions are never trained on. This module knows nothing about teachers,
losses or adapters.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pc_rag.errors import PCRagError
from pc_rag.eval.contexts import passage_id, passage_text, pooled_store
from pc_rag.eval.datasets import Example
from pc_rag.rag.engine import Chunk, RagEngine

VARIANTS = ("closed", "closed-shuffled", "open", "open-best-last")
_BUILD_PART = 256  # passages per saved step of a store build


@dataclass(frozen=True)
class Pair:
    """One training context: chunk documents of ``store`` in order, and the question asked after them."""

    key: str  # "<example id>/<variant>"
    split: str  # "train" or "val"
    store: str  # "closed" or "open"
    doc_ids: tuple[str, ...]
    question: str


class PairSource:
    """The pairs of ``examples`` for ``variants``, and the chunks behind each pair (KV from the stores)."""

    def __init__(
        self,
        engine: RagEngine,
        examples: Sequence[Example],
        directory: str | Path,
        variants: Sequence[str] = VARIANTS,
        *,
        val_from: int,
        k: int = 10,
        embedder: object | None = None,
        storage_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        unknown = set(variants) - set(VARIANTS)
        if unknown or not variants:
            msg = f"unknown or no variants {sorted(unknown)}; known: {', '.join(VARIANTS)}"
            raise PCRagError(msg)
        self.engine, self.examples, self.variants, self.val_from, self.k = engine, list(examples), variants, val_from, k
        self.directory, self.embedder, self.storage_dtype = Path(directory), embedder, storage_dtype
        self._stores: dict[str, object] = {}
        self._retrieved: dict[str, list[str]] = {}

    def pairs(self) -> Iterator[Pair]:
        """Pairs variant by variant (every example of the first variant, then the next), building stores as needed.

        Variant-major order lets a partly generated teacher set already cover every example.
        """
        for variant in self.variants:
            for index, example in enumerate(self.examples):
                yield self._pair(example, variant, "val" if index >= self.val_from else "train")

    def chunks(self, pair: Pair) -> list[Chunk]:
        """The engine chunks (token ids and KV) of ``pair``, in its order."""
        store = self._store(pair.store)
        handles = [store.handle(store.manifest.docs[d].chunk_ids[0]) for d in pair.doc_ids]
        return store.chunks(handles)

    def _pair(self, example: Example, variant: str, split: str) -> Pair:
        key = f"{example.id}/{variant}"
        if variant.startswith("closed"):
            ids = [_closed_id(t) for t in self._closed_texts(example)]
            if variant == "closed-shuffled":
                random.Random(key).shuffle(ids)
            return Pair(key, split, "closed", tuple(ids), example.question)
        if example.id not in self._retrieved:  # the same search for every open variant and every pass
            self._retrieved[example.id] = [h.doc_id for h in self._store("open").search(example.question, self.k)]
        ids = list(self._retrieved[example.id])
        if variant == "open-best-last":
            ids.reverse()
        return Pair(key, split, "open", tuple(ids), example.question)

    def _closed_texts(self, example: Example) -> list[str]:
        return [self.engine.passage_text(i, p.title, p.text) for i, p in enumerate(example.passages, start=1)]

    def _store(self, kind: str):
        if kind not in self._stores:
            if kind == "closed":
                docs = {_closed_id(t): (t, {}) for ex in self.examples for t in self._closed_texts(ex)}
            else:
                docs = {passage_id(p): (passage_text(p), {}) for ex in self.examples for p in ex.passages}
            self._stores[kind] = pooled_store(
                self.directory / f"{kind}-store", self.engine, docs, "prefix", self.embedder,
                storage_dtype=self.storage_dtype, part=_BUILD_PART,
            )  # fmt: skip
        return self._stores[kind]


def _closed_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
