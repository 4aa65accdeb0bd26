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
    cost: dict[str, float] = {}
    start = time.perf_counter()
    written = source.write_questions(progress=progress)
    _spent(cost, "questions", written, start)
    kept = {s: len(source.kept(s)) for s in ("train", "val")}
    retrieved = sum(r.source_retrieved for s in kept for r in source.kept(s)) / max(1, sum(kept.values()))
    if not all(kept.values()):
        msg = (f"{store.directory}: no usable question for the {'held-out' if not kept['val'] else 'training'} part "
               f"({kept}); give a larger --pairs or a store with more documents")  # fmt: skip
        raise PCRagError(msg)
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


def _spent(cost: dict[str, float], phase: str, count: int, start: float) -> None:
    seconds = time.perf_counter() - start
    cost[f"{phase}_s"], cost[f"{phase}_count"] = round(seconds, 1), count
    if count:
        cost[f"{phase}_s_each"] = round(seconds / count, 2)
    logger.info("%s: %d in %.1f min (%.1f s each)", phase, count, seconds / 60, seconds / max(1, count))
