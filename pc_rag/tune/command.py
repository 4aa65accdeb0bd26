"""``pc-rag tune``: teacher data for the tuning split, then a splice adapter trained on it.

Both phases resume: the teacher set and the chunk stores live in ``--work`` and are
extended, never rebuilt; training starts from scratch each run (it is the cheap part)
and writes the adapter where ``RagEngine`` finds it for this model, plus a JSON report
of the validation history. This module knows nothing about serving.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from pc_rag.errors import PCRagError
from pc_rag.eval.datasets import TUNING_SPLIT, load_examples, tuning_split
from pc_rag.rag.adapter import AdapterConfig
from pc_rag.rag.engine import RagEngine
from pc_rag.rag.tuned import calibration_file
from pc_rag.tune.calibrate import fit_calibration
from pc_rag.tune.pairs import VARIANTS, PairSource
from pc_rag.tune.teacher import TeacherSet, build_teacher
from pc_rag.tune.train import TrainConfig, train_adapter

logger = logging.getLogger(__name__)

VALIDATION_SIZE = 50  # the last questions of the range: early stopping only, never trained on


def tune(
    engine: RagEngine,
    dataset: Path,
    work: Path,
    out: Path,
    *,
    variants: tuple[str, ...] = VARIANTS,
    adapter_config: AdapterConfig,
    train_config: TrainConfig,
    teacher_only: bool = False,
    calibration_grid: tuple[Sequence[float], Sequence[float]] | None = None,
    progress: bool = True,
    questions: int | None = None,
    init: Path | None = None,
) -> dict:
    """Generate (or resume) the teacher set, train, save the adapter at ``out``; return the report.

    ``questions``: train on only the first that many questions of the split, for a cheaper run (validation stays
    the split's last ``VALIDATION_SIZE``). ``init``: start from the adapter in this file.

    With ``calibration_grid`` (temperatures, scales) APE's (T, S) is then fitted on the validation pairs
    with the adapter applied and saved beside it (``<fingerprint>.calibration.json``).
    """
    split = tuning_split(load_examples(dataset))
    wanted = sum(len(r) for r in TUNING_SPLIT.values())
    if len(split) != wanted:
        msg = f"{dataset} holds {len(split)} questions of the tuning split ({TUNING_SPLIT}), not {wanted}"
        raise PCRagError(msg)
    if questions is not None:
        split = split[: min(questions, len(split) - VALIDATION_SIZE)] + split[-VALIDATION_SIZE:]
    source = PairSource(engine, split, work, variants, val_from=len(split) - VALIDATION_SIZE)
    teacher = TeacherSet(work / "teacher")
    build_teacher(source, teacher, progress=progress)
    if teacher_only:
        return {"teacher_pairs": len(teacher)}
    return train_and_save(
        engine, source, teacher, out, adapter_config=adapter_config, train_config=train_config,
        calibration_grid=calibration_grid, progress=progress, init=init,
        extra={"variants": list(variants), "questions": len(split) - VALIDATION_SIZE},
    )  # fmt: skip


def train_and_save(
    engine: RagEngine,
    source: PairSource,
    teacher: TeacherSet,
    out: Path,
    *,
    adapter_config: AdapterConfig,
    train_config: TrainConfig,
    calibration_grid: tuple[Sequence[float], Sequence[float]] | None = None,
    progress: bool = True,
    extra: dict | None = None,
    init: Path | None = None,
) -> dict:
    """Train on the taught pairs of ``source``, save the adapter at ``out`` (and the calibration beside it), write
    the report (with ``extra``) at ``out`` with a ``.json`` suffix and return it."""
    pairs = [p for p in source.pairs() if p.key in teacher]
    train = [p for p in pairs if p.split == "train"]
    val = [p for p in pairs if p.split == "val"]
    adapter, report = train_adapter(
        engine, train, val, source.chunks, teacher.get, adapter_config, train_config, progress=progress, init=init
    )
    adapter.save(out)
    summary = {
        "adapter": str(out),
        "fingerprint": adapter.fingerprint,
        "adapter_config": asdict(adapter_config),
        "train_config": asdict(train_config),
        **(extra or {}),
        "init": str(init) if init is not None else None,
        "cost": {"train_s": round(report.seconds, 1), "train_pair_steps": report.pair_steps},
        "train_pairs": len(train),
        "val_pairs": len(val),
        "history": [asdict(v) for v in report.history],
        "best": asdict(report.best) if report.best else None,
    }
    if calibration_grid is not None:
        calibration, grid = fit_calibration(
            engine, val, source.chunks, teacher.get, *calibration_grid, adapter=adapter.attach(), progress=progress
        )
        adapter.detach()
        path = out.parent / calibration_file(adapter.fingerprint)
        calibration.save(path, adapter.fingerprint)
        summary["calibration"] = {"path": str(path), **asdict(calibration)}
        summary["calibration_grid"] = [
            {"temperature": p.temperature, "scale": p.scale, **asdict(p.result)} for p in grid
        ]
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary
