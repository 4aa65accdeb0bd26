"""``pc-rag tune --store``: a splice adapter trained on a document store's own chunks, without labels.

Three phases, each resumable from the work directory: the model writes questions about sampled
chunks and the store retrieves each question's context (``store_pairs``); full prefill of each
context and question is the teacher (``teacher``); the adapter is trained against it and the best
one on the held-out documents' pairs is kept (``command.train_and_save``, as ``tune --dataset``).
The report beside the adapter adds the store, the question counts and what each phase cost in this
run. This module knows nothing about how questions are written or how training works.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path

from pc_rag.errors import PCRagError
from pc_rag.rag.adapter import AdapterConfig
from pc_rag.store.document_store import DocumentStore
from pc_rag.tune.command import train_and_save
from pc_rag.tune.store_pairs import HELD_OUT, StorePairSource
from pc_rag.tune.teacher import TeacherSet, build_teacher
from pc_rag.tune.train import TrainConfig

logger = logging.getLogger(__name__)

MIN_PAIRS = {"train": 16, "val": 4}  # fewer usable questions than this: refused (an adapter fitted to noise)


def tune_store(
    store: DocumentStore,
    work: Path,
    out: Path,
    *,
    pairs: int,
    k: int = 5,
    held_out: float = HELD_OUT,
    adapter_config: AdapterConfig,
    train_config: TrainConfig,
    teacher_only: bool = False,
    calibration_grid: tuple[Sequence[float], Sequence[float]] | None = None,
    progress: bool = True,
    init: Path | None = None,
) -> dict:
    """Write questions, teach, train and save the adapter at ``out`` (starting from ``init`` if given); return the
    report (``teacher_only``: stop after the teacher, returning the counts and costs so far)."""
    source = StorePairSource(store, work, pairs=pairs, k=k, held_out=held_out)
    _check_wanted(source.wanted, pairs, held_out)
    _check_chunks(source)
    cost: dict[str, float] = {}
    start = time.perf_counter()
    written = source.write_questions(progress=progress)
    _spent(cost, "questions", written, start)
    kept = {s: len(source.kept(s)) for s in ("train", "val")}
    retrieved = sum(r.source_retrieved for s in kept for r in source.kept(s)) / max(1, sum(kept.values()))
    _check_kept(source)
    report = {"store": str(store.directory), "questions_kept": kept, "questions_written": len(source.records),
              "source_chunk_retrieved": round(retrieved, 3)}  # fmt: skip
    teacher = TeacherSet(work / "teacher")
    start = time.perf_counter()
    taught = build_teacher(source, teacher, progress=progress, total=sum(kept.values()))
    _spent(cost, "teacher", taught, start)
    if teacher_only:
        return {**report, "teacher_pairs": len(teacher), "cost": cost}
    start = time.perf_counter()
    summary = train_and_save(
        store.engine, source, teacher, out, adapter_config=adapter_config, train_config=train_config,
        calibration_grid=calibration_grid, progress=progress, extra=report, init=init,
    )  # fmt: skip
    _spent(cost, "train", summary["history"][-1]["pairs_seen"], start)  # per training pair step, validations included
    summary["cost"] = {**cost, "validation_pairs_run": len(summary["history"]) * summary["val_pairs"]}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


def _check_wanted(wanted: dict[str, int], pairs: int, held_out: float) -> None:
    """Refuse a ``--pairs`` (and ``--held-out``) that asks for fewer questions than ``MIN_PAIRS``."""
    if all(wanted[s] >= MIN_PAIRS[s] for s in MIN_PAIRS):
        return
    least = max(sum(MIN_PAIRS.values()), math.ceil((MIN_PAIRS["val"] - 0.5) / held_out))
    msg = (f"--pairs {pairs} with --held-out {held_out} asks for {wanted['train']} training and {wanted['val']} "
           f"held-out questions; tune --store needs at least {MIN_PAIRS['train']} and {MIN_PAIRS['val']}: "
           f"give --pairs {least} or more")  # fmt: skip
    raise PCRagError(msg)


def _check_chunks(source: StorePairSource) -> None:
    """Refuse a store with fewer chunks than ``MIN_PAIRS`` questions (one question per chunk at most), before
    any question is written."""
    have = source.chunk_counts()
    if all(have[s] >= MIN_PAIRS[s] for s in MIN_PAIRS):
        return
    msg = (f"{source.store.directory}: {have['train']} chunks in training documents and {have['val']} in held-out "
           f"ones; the model writes at most one question per chunk and tune --store needs at least "
           f"{MIN_PAIRS['train']} and {MIN_PAIRS['val']} usable ones (usually several times as many chunks): "
           "index more documents")  # fmt: skip
    raise PCRagError(msg)


def _check_kept(source: StorePairSource) -> None:
    """Refuse to train when the store gave fewer usable questions than ``MIN_PAIRS``, saying how many chunks
    would give enough at the share of written questions that was usable."""
    kept = {s: len(source.kept(s)) for s in MIN_PAIRS}
    if all(kept[s] >= MIN_PAIRS[s] for s in MIN_PAIRS):
        return
    written = len(source.records)
    usable = sum(r.question is not None for r in source.records.values())
    have = source.chunk_counts()
    if usable == 0:
        need = f"none of the {written} questions the model wrote was usable, so no number of chunks is known to do"
    else:
        rate = usable / written
        wants = {s: math.ceil(MIN_PAIRS[s] / rate) for s in MIN_PAIRS}
        need = (f"{usable} of the {written} questions written were usable ({rate:.0%}); at that rate it needs about "
                f"{wants['train']} chunks in training documents and {wants['val']} in held-out ones "
                f"(the store has {have['train']} and {have['val']})")  # fmt: skip
    msg = (f"{source.store.directory}: {kept['train']} training and {kept['val']} held-out questions, fewer than the "
           f"{MIN_PAIRS['train']} and {MIN_PAIRS['val']} tune --store needs; {need}: index more documents "
           "(or a larger model writes more usable questions)")  # fmt: skip
    raise PCRagError(msg)


def _spent(cost: dict[str, float], phase: str, count: int, start: float) -> None:
    seconds = time.perf_counter() - start
    cost[f"{phase}_s"], cost[f"{phase}_count"] = round(seconds, 1), count
    if count:
        cost[f"{phase}_s_each"] = round(seconds / count, 2)
    logger.info("%s: %d in %.1f min (%.1f s each)", phase, count, seconds / 60, seconds / max(1, count))
