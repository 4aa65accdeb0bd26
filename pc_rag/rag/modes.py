"""Recovery modes: how separately encoded chunks regain the cross-chunk attention they never saw.

A mode says how chunks are encoded (alone, or after the shared preamble) and
which of their tokens are recomputed at query time with full attention to
everything before them. This module only describes modes; ``recompute.py`` and
``engine.py`` carry them out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pc_rag.errors import PCRagError


@dataclass(frozen=True)
class RecoveryMode:
    """``conditioned``: chunks attend to the preamble when encoded. ``edge``: recompute each chunk's first
    ``edge`` tokens. ``ratio``: also recompute that share of chunk tokens with the largest value deviation
    (CacheBlend), measured on the values of layer ``probe_layer``."""

    name: str
    conditioned: bool = True
    edge: int = 0
    ratio: float = 0.0
    probe_layer: int = 1

    @property
    def recomputes(self) -> bool:
        return self.edge > 0 or self.ratio > 0


MODES: dict[str, RecoveryMode] = {
    "naive": RecoveryMode("naive", conditioned=False),
    "prefix": RecoveryMode("prefix"),
    "edge": RecoveryMode("edge", edge=16),
    "selective": RecoveryMode("selective", ratio=0.15),
    "hybrid": RecoveryMode("hybrid", edge=8, ratio=0.10),
}
MODES["default"] = RecoveryMode("default", ratio=0.25)  # selective:0.25: the cheapest budget keeping first-token
# KL to full prefill near 0.05 in our measurements (README, speed-quality curve)

_BUDGETED = {"edge": "edge", "selective": "ratio", "hybrid": "ratio"}  # base mode -> the field a budget sets


def resolve_mode(spec: str | RecoveryMode) -> RecoveryMode:
    """A mode by name (``MODES``) or ``base:budget``: ``edge:32`` (tokens per chunk), ``selective:0.25`` or
    ``hybrid:0.2`` (share of chunk tokens recomputed by deviation; hybrid adds its edge tokens)."""
    if isinstance(spec, RecoveryMode):
        return spec
    if spec in MODES:
        return MODES[spec]
    base, sep, budget = spec.partition(":")
    if sep and base in _BUDGETED:
        field = _BUDGETED[base]
        try:
            value = int(budget) if field == "edge" else float(budget)
        except ValueError:
            value = -1
        if (field == "edge" and value >= 1) or (field == "ratio" and 0 < value <= 1):
            return replace(MODES[base], name=spec, **{field: value})
    known = ", ".join([*MODES, "edge:<tokens>", "selective:<share>", "hybrid:<share>"])
    msg = f"unknown recovery mode {spec!r}; known: {known}"
    raise PCRagError(msg)


def is_mode(spec: str) -> bool:
    """Whether ``resolve_mode`` accepts ``spec``."""
    try:
        resolve_mode(spec)
    except PCRagError:
        return False
    return True
