"""Recovery modes: how separately encoded chunks regain the cross-chunk attention they never saw.

A mode says how chunks are encoded (alone, or after the shared preamble) and
which of their tokens are recomputed at query time with full attention to
everything before them. This module only describes modes; ``recompute.py`` and
``engine.py`` carry them out.
"""

from __future__ import annotations

from dataclasses import dataclass


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
MODES["default"] = MODES["hybrid"]  # best first-token KL in our measurements (README)
