"""Fit APE's (temperature, scale) by minimizing KL(full prefill || spliced) on tuning pairs.

A grid search over global ``(T, S)`` on teacher records (no new teacher passes: the
student is the only forward), optionally on top of a splice adapter. Every grid point
is reported, so the fit can be read as a table. This module knows nothing about how
pairs or records are produced.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product

from tqdm import tqdm

from pc_rag.calibration import Calibration
from pc_rag.rag.adapter import SpliceAdapter
from pc_rag.rag.engine import Chunk, RagEngine
from pc_rag.tune.pairs import Pair
from pc_rag.tune.teacher import TeacherRecord
from pc_rag.tune.train import Validation, validate


@dataclass(frozen=True)
class GridPoint:
    """KL at one ``(temperature, scale)``."""

    temperature: float
    scale: float
    result: Validation


def fit_calibration(
    engine: RagEngine,
    pairs: Sequence[Pair],
    chunks: Callable[[Pair], list[Chunk]],
    teacher: Callable[[str], TeacherRecord],
    temperatures: Sequence[float],
    scales: Sequence[float],
    adapter: SpliceAdapter | None = None,
    *,
    progress: bool = True,
) -> tuple[Calibration, list[GridPoint]]:
    """The grid point with the lowest mean KL over the teacher's steps, and every point measured."""
    points = []
    grid = list(product(temperatures, scales))
    for t, s in tqdm(grid, desc="calibration grid", disable=not progress):
        result = validate(engine, adapter, pairs, chunks, teacher, calibration=Calibration(t, s))
        points.append(GridPoint(t, s, result))
    best = min(points, key=lambda p: p.result.mean_kl)
    return Calibration(best.temperature, best.scale), points
