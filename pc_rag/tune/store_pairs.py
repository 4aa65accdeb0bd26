"""Training pairs from a document store's own chunks: a question the model writes about a chunk, and the
chunks the store retrieves for that question, laid out as serving lays them out.

Chunks are visited in the order of a stable hash of (document, place in it, text), so every run
samples the same ones. The documents whose hash falls under ``held_out`` (at least one when the
store has two) are the validation part: their chunks give validation questions only, and training
questions retrieve from the other documents alone, so nothing held out is ever trained on. Written
questions go to ``questions.jsonl`` in the work directory, one line each (kept or rejected) with its
context as chunk keys, fsynced as it is written: a rerun writes only what is missing, and contexts
survive a store's chunks being renumbered by ``compact``. ``pairs()`` yields kept questions in the
order they were written. This module knows nothing about teachers, losses or adapters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from pc_rag.errors import PCRagError
from pc_rag.rag.chunk import Chunk
from pc_rag.rag.engine import RagEngine
from pc_rag.rag.order import DEFAULT_ORDER, reorder
from pc_rag.store.document_store import DocumentStore
from pc_rag.tune.pairs import Pair
from pc_rag.tune.questions import clean_question, prompt_digest, write_question

logger = logging.getLogger(__name__)

HELD_OUT = 0.1  # share of documents kept for validation


@dataclass(frozen=True)
class QuestionRecord:
    """One chunk's question: ``question`` is None when the model's ``raw`` reply was degenerate."""

    key: str  # the chunk's key (``chunk_key``)
    split: str  # "train" or "val"
    raw: str
    question: str | None
    context: tuple[str, ...]  # chunk keys as laid out for the answer
    source_retrieved: bool  # whether the chunk the question was written from is in its context


def chunk_key(doc_id: str, place: int, text: str) -> str:
    """A chunk's stable identity: its document, its place in it and its text."""
    return hashlib.sha256(f"{doc_id}\x00{place}\x00{text}".encode()).hexdigest()[:16]


def _unit(text: str) -> float:
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16) / 16**15


def held_out_documents(doc_ids: Iterable[str], share: float = HELD_OUT) -> set[str]:
    """The documents kept for validation: those whose stable hash is under ``share`` (the lowest one when none is
    and there are two or more documents)."""
    ranked = sorted(doc_ids, key=_unit)
    held = {d for d in ranked if _unit(d) < share}
    return held or ({ranked[0]} if share > 0 and len(ranked) > 1 else set())


class StorePairSource:
    """Up to ``pairs`` (chunks, question) pairs from ``store`` (about ``held_out`` of them for validation), each
    with the top ``k`` chunks the store retrieves for its question; ``write_questions`` makes what is missing
    (``write``: the question writer, default ``questions.write_question``)."""

    def __init__(
        self,
        store: DocumentStore,
        directory: str | Path,
        *,
        pairs: int,
        k: int = 5,
        held_out: float = HELD_OUT,
        write: Callable[[RagEngine, str], str] | None = None,
    ) -> None:
        if pairs < 2 or k < 1 or not 0 < held_out < 1:
            msg = f"tune --store needs --pairs >= 2, -k >= 1 and 0 < --held-out < 1; got {pairs}, {k}, {held_out}"
            raise PCRagError(msg)
        self.store, self.engine, self.k, self.write = store, store.engine, k, write or write_question
        self.directory = Path(directory)
        self.val_wanted = max(1, round(pairs * held_out))
        self.wanted = {"train": pairs - self.val_wanted, "val": self.val_wanted}
        manifest = store.manifest
        held = held_out_documents(manifest.docs, held_out)
        if len(manifest.docs) < 2:
            msg = f"the store at {store.directory} has {len(manifest.docs)} document(s); tune --store needs two or more"
            raise PCRagError(msg)
        self._ids: dict[str, int] = {}  # chunk key -> chunk id
        self._split: dict[str, str] = {}
        for doc_id, doc in manifest.docs.items():
            for place, cid in enumerate(doc.chunk_ids):
                key = chunk_key(doc_id, place, manifest.chunks[cid].text)
                self._ids[key], self._split[key] = cid, "val" if doc_id in held else "train"
        self._keys = {cid: key for key, cid in self._ids.items()}
        self._order = sorted(self._ids, key=_unit)
        self._path = self.directory / "questions.jsonl"
        self._check_settings({"k": k, "held_out": held_out, "prompt": prompt_digest(self.engine),
                              "model": self.engine.lm.fingerprint()})  # fmt: skip
        self.records: dict[str, QuestionRecord] = self._load()

    def kept(self, split: str) -> list[QuestionRecord]:
        """Kept questions of ``split``, in the order they were written, at most as many as wanted."""
        kept = [r for r in self.records.values() if r.split == split and r.question is not None]
        return kept[: self.wanted[split]]

    def chunk_counts(self) -> dict[str, int]:
        """Chunks of the store in training and in held-out documents."""
        return {s: sum(v == s for v in self._split.values()) for s in ("train", "val")}

    def write_questions(self, *, progress: bool = True) -> int:
        """Write questions for unvisited chunks until each split has what it wants (or runs out); return how many."""
        missing = {s: self.wanted[s] - len(self.kept(s)) for s in self.wanted}
        bar = tqdm(total=sum(self.wanted.values()), initial=sum(self.wanted.values()) - sum(missing.values()),
                   desc="questions", unit="pair", disable=not progress)  # fmt: skip
        written = 0
        with self._path.open("a", encoding="utf-8") as f:
            for key in self._order:
                split = self._split[key]
                if not any(missing.values()):
                    break
                if missing[split] == 0 or key in self.records:
                    continue
                record = self._question(key, split)
                f.write(json.dumps(asdict(record)) + "\n")
                f.flush()
                os.fsync(f.fileno())
                self.records[key] = record
                written += 1
                if record.question is not None:
                    missing[split] -= 1
                    bar.update()
        bar.close()
        if any(missing.values()):
            logger.warning("the store ran out of chunks: %s questions short of --pairs", sum(missing.values()))
        return written

    def pairs(self) -> Iterator[Pair]:
        """Validation pairs first (early stopping needs them all), then training pairs."""
        for split in ("val", "train"):
            for r in self.kept(split):
                yield Pair(r.key, split, "store", tuple(str(self._ids[c]) for c in r.context), r.question or "")

    def chunks(self, pair: Pair) -> list[Chunk]:
        """The store's chunks (token ids and KV) of ``pair``, in its layout."""
        return self.store.chunks([self.store.handle(int(i)) for i in pair.doc_ids])

    def _question(self, key: str, split: str) -> QuestionRecord:
        passage = self.store.manifest.chunks[self._ids[key]].text
        raw = self.write(self.engine, passage)
        question = clean_question(raw, passage)
        if question is None:
            return QuestionRecord(key, split, raw, None, (), False)
        context = self._retrieve(question, exclude_held_out=split == "train")
        return QuestionRecord(key, split, raw, question, tuple(context), key in context)

    def _retrieve(self, question: str, *, exclude_held_out: bool) -> list[str]:
        """Keys of the top ``k`` chunks for ``question`` (training: from training documents only), laid out as
        serving lays them out."""
        n = self.k
        while True:
            hits = [self._keys[h.chunk_id] for h in self.store.search(question, n)]
            kept = [c for c in hits if not exclude_held_out or self._split[c] == "train"][: self.k]
            if len(kept) == self.k or len(hits) < n:
                return reorder(kept, DEFAULT_ORDER)
            n *= 4

    def _check_settings(self, settings: dict) -> None:
        path = self.directory / "store-pairs.json"
        if path.is_file():
            before = json.loads(path.read_text(encoding="utf-8"))
            if before != settings:
                changed = ", ".join(k for k in settings if before.get(k) != settings[k])
                msg = f"{self.directory} holds pairs made with another {changed}: give another --work or the same one"
                raise PCRagError(msg)
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(settings) + "\n", encoding="utf-8")

    def _load(self) -> dict[str, QuestionRecord]:
        records: dict[str, QuestionRecord] = {}
        if not self._path.is_file():
            return records
        lines = self._path.read_text(encoding="utf-8").splitlines()
        gone = 0
        for lineno, line in enumerate(lines, start=1):
            try:
                r = json.loads(line)
                record = QuestionRecord(r["key"], r["split"], r["raw"], r["question"], tuple(r["context"]),
                                        r["source_retrieved"])  # fmt: skip
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                if lineno == len(lines):
                    break  # a line cut short by a crash: that chunk's question is written again
                msg = f"{self._path}:{lineno}: not a question record ({e}); delete the file to start over"
                raise PCRagError(msg) from e
            if self._split.get(record.key) == record.split and all(c in self._ids for c in record.context):
                records[record.key] = record
            else:
                gone += 1
        if gone:
            logger.warning("%d written questions skipped: their chunks left the store or changed split", gone)
        return records
