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
    ``edge`` tokens. ``ratio``: also recompute that share of chunk tokens, chosen by ``selection``:
    ``"deviation"``, the largest value deviation at layer ``probe_layer`` (CacheBlend), or ``"query"``, the
    most attention from the question over the stale cache in the first ``query_layers`` layers, widened by
    ``window`` tokens on each side (ProphetKV), or ``"blend"``, the largest product of the two.
    ``adapter``: apply the model's splice adapter to the tokens
    computed at query time, or with ``adapter_skips_recomputed`` only to the question and generated tokens
    (recomputed chunk tokens then run as the plain model). ``calibrated``: APE-calibrate their attention to
    stale chunk keys."""

    name: str
    conditioned: bool = True
    edge: int = 0
    ratio: float = 0.0
    probe_layer: int = 1
    selection: str = "deviation"
    query_layers: int = 2
    window: int = 0
    adapter: bool = False
    adapter_skips_recomputed: bool = False
    calibrated: bool = False

    @property
    def recomputes(self) -> bool:
        return self.edge > 0 or self.ratio > 0


MODES: dict[str, RecoveryMode] = {
    "naive": RecoveryMode("naive", conditioned=False),
    "prefix": RecoveryMode("prefix"),
    "edge": RecoveryMode("edge", edge=16),
    "selective": RecoveryMode("selective", ratio=0.15),
    "hybrid": RecoveryMode("hybrid", edge=8, ratio=0.10),
    "query": RecoveryMode("query", ratio=0.10, selection="query", window=1),
    "blend": RecoveryMode("blend", ratio=0.15, selection="blend"),
    "fast": RecoveryMode("fast", adapter=True),  # no recompute: the splice adapter alone
}
MODES["default"] = RecoveryMode("default", ratio=0.25)  # selective:0.25: the cheapest budget keeping first-token
# KL to full prefill near 0.05 (README, speed-quality curve). It was the default mode before issue 32 and keeps
# its name: stores created then record "default" and still answer with it, and the eval results use the name.

# What a new store and a call without a mode get (issue 32, examples/results/default_mode_choice.json): the
# fastest mode whose F1 stays within noise of full prefill in the closed and open dev runs; a model without a
# trained splice adapter gets the best mode that needs none.
DEFAULT_MODE = "fast"
ADAPTER_FREE_MODE = "prefix"

# base -> budget field
_BUDGETED = {"edge": "edge", "selective": "ratio", "hybrid": "ratio", "query": "ratio", "blend": "ratio"}
_LEVERS = {  # "+name" suffix -> the fields it sets
    "adapter": {"adapter": True},
    "adapter-question": {"adapter": True, "adapter_skips_recomputed": True},
    "ape": {"calibrated": True},
}


def resolve_mode(spec: str | RecoveryMode) -> RecoveryMode:
    """A mode by name (``MODES``) or ``base:budget``: ``edge:32`` (tokens per chunk), ``selective:0.25``,
    ``hybrid:0.2`` or ``query:0.1`` (share of chunk tokens recomputed; hybrid adds its edge tokens), each
    optionally followed by levers: ``+adapter`` (splice adapter), ``+adapter-question`` (the adapter on the
    question and answer only, not on recomputed chunk tokens), ``+ape`` (attention calibration), e.g.
    ``prefix+adapter+ape`` or ``query:0.05+adapter``."""
    if isinstance(spec, RecoveryMode):
        return spec
    base_spec, *levers = spec.split("+")
    mode = _base_mode(base_spec)
    if mode is None or any(lever not in _LEVERS for lever in levers):
        budgets = (f"{base}:<{'tokens' if field == 'edge' else 'share'}>" for base, field in _BUDGETED.items())
        known = ", ".join([*MODES, *budgets])
        levers_known = " and/or ".join(f"+{lever}" for lever in _LEVERS)
        msg = f"unknown recovery mode {spec!r}; known: {known}, each optionally with {levers_known}"
        raise PCRagError(msg)
    if not levers:
        return mode
    return replace(mode, name=spec, **{k: v for lever in levers for k, v in _LEVERS[lever].items()})


def _base_mode(spec: str) -> RecoveryMode | None:
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
    return None


def is_mode(spec: str) -> bool:
    """Whether ``resolve_mode`` accepts ``spec``."""
    try:
        resolve_mode(spec)
    except PCRagError:
        return False
    return True
