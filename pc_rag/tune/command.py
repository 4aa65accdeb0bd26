"""``pc-rag tune``: teacher data for the tuning split, then a splice adapter trained on it.

Both phases resume: the teacher set and the chunk stores live in ``--work`` and are
extended, never rebuilt; training starts from scratch each run (it is the cheap part)
and writes the adapter where ``RagEngine`` finds it for this model, plus a JSON report
of the validation history. This module knows nothing about serving.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

from pc_rag.errors import PCRagError
from pc_rag.eval.datasets import load_examples
from pc_rag.rag.adapter import AdapterConfig
from pc_rag.rag.engine import RagEngine
from pc_rag.tune.pairs import VARIANTS, PairSource
from pc_rag.tune.teacher import TeacherSet, build_teacher
from pc_rag.tune.train import TrainConfig, train_adapter

logger = logging.getLogger(__name__)

TUNING_DATASET = "hotpotqa"
TUNING_RANGE = range(300, 700)  # HotpotQA dev questions reserved for training; never evaluated
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
    progress: bool = True,
) -> dict:
    """Generate (or resume) the teacher set, train, save the adapter at ``out``; return the report."""
    examples = load_examples(dataset)
    if not examples or examples[0].dataset != TUNING_DATASET:
        msg = f"{dataset} is not the {TUNING_DATASET} dev data the tuning split is defined on"
        raise PCRagError(msg)
    if len(examples) < TUNING_RANGE.stop:
        msg = f"{dataset} has {len(examples)} questions; the tuning split needs {TUNING_RANGE.stop}"
        raise PCRagError(msg)
    split = examples[TUNING_RANGE.start : TUNING_RANGE.stop]
    source = PairSource(engine, split, work, variants, val_from=len(split) - VALIDATION_SIZE)
    teacher = TeacherSet(work / "teacher")
    build_teacher(source, teacher, progress=progress)
    if teacher_only:
        return {"teacher_pairs": len(teacher)}
    pairs = [p for p in source.pairs() if p.key in teacher]
    train = [p for p in pairs if p.split == "train"]
    val = [p for p in pairs if p.split == "val"]
    adapter, report = train_adapter(
        engine, train, val, source.chunks, teacher.get, adapter_config, train_config, progress=progress
    )
    adapter.save(out)
    summary = {
        "adapter": str(out),
        "fingerprint": adapter.fingerprint,
        "adapter_config": asdict(adapter_config),
        "train_config": asdict(train_config),
        "variants": list(variants),
        "train_pairs": len(train),
        "val_pairs": len(val),
        "history": [asdict(v) for v in report.history],
        "best": asdict(report.best) if report.best else None,
    }
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return summary
