"""``pc-rag tune``: teacher data for the tuning split, then a splice adapter trained on it.

Both phases resume: the teacher set and the chunk stores live in ``--work`` and are
extended, never rebuilt; training starts from scratch each run (it is the cheap part)
and writes the adapter to a file of its own (never where serving looks: ``pc-rag tune --install``
puts it there), plus a JSON report of the validation history and of the adapter serving had at
the time, on the same held-out pairs. This module knows nothing about serving.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from pc_rag.errors import PCRagError
from pc_rag.eval.datasets import TUNING_SPLIT, load_examples, tuning_split
from pc_rag.rag.adapter import AdapterConfig, SpliceAdapter
from pc_rag.rag.engine import RagEngine
from pc_rag.rag.tuned import installed_adapter
from pc_rag.store._atomic import sha256_file
from pc_rag.tune.calibrate import fit_calibration
from pc_rag.tune.pairs import VARIANTS, Pair, PairSource
from pc_rag.tune.teacher import TeacherSet, build_teacher
from pc_rag.tune.train import TrainConfig, train_adapter, validate

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
    the report (with ``extra``) at ``out`` with a ``.json`` suffix and return it.

    The report's ``installed`` entry is the adapter serving finds for this model now, validated on the same
    held-out pairs (None when it has none): what ``pc-rag tune --install`` compares against."""
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
        "installed": _installed_on(engine, val, source, teacher, train_config),
    }
    if calibration_grid is not None:
        calibration, grid = fit_calibration(
            engine, val, source.chunks, teacher.get, *calibration_grid, adapter=adapter.attach(), progress=progress
        )
        adapter.detach()
        path = calibration_beside(out)
        calibration.save(path, adapter.fingerprint)
        summary["calibration"] = {"path": str(path), **asdict(calibration)}
        summary["calibration_grid"] = [
            {"temperature": p.temperature, "scale": p.scale, **asdict(p.result)} for p in grid
        ]
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary


def calibration_beside(adapter: Path) -> Path:
    """Where a trained adapter's APE calibration is written: ``<name>.calibration.json`` beside it."""
    return adapter.with_name(f"{adapter.stem}.calibration.json")


def _installed_on(
    engine: RagEngine, val: list[Pair], source: PairSource, teacher: TeacherSet, config: TrainConfig
) -> dict | None:
    """The installed adapter of ``engine``'s model (path, sha256) and its validation on ``val``, or None."""
    fingerprint = engine.lm.fingerprint()
    path = installed_adapter(fingerprint)
    if path is None:
        return None
    adapter = SpliceAdapter.load(path, engine.lm.model, fingerprint).attach()
    try:
        result = validate(engine, adapter, val, source.chunks, teacher.get, recompute=config.share)
    finally:
        adapter.detach()
    return {"path": str(path), "sha256": sha256_file(path), **asdict(result)}
