"""APE-style attention calibration for tokens computed over spliced chunks (Yang et al., ICLR 2025).

Chunks encoded separately each carry an attention sink and never compete with one
another, so a question attending to many spliced chunks spreads too much of its
attention over them. APE rescales that attention: scores against *stale* chunk keys
(spliced, not recomputed) are divided by a temperature ``T``, and the chunk segment's
log-sum-exp is multiplied by ``S * T`` before it is merged with the exact keys (the
preamble, recomputed chunk tokens, the new tokens). With ``T = S = 1`` this is plain
attention. Merging by log-sum-exp is the same as one softmax over adjusted scores:
a stale key's score becomes ``s / T + (S * T - 1) * lse(stale scores / T)``, which is
how it is computed here, for the few query-time rows only (the question, decode steps).

``Segments`` travels with a request through the model call as the attention kwarg
``pc_rag_segments``; ``Calibration`` holds global or per-layer ``(T, S)`` and is stored
as JSON keyed by the model fingerprint. This module knows nothing about chunks or modes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pc_rag.errors import PCRagError

KWARG = "pc_rag_segments"
FORMAT = "pc-rag-calibration/1"


@dataclass(frozen=True)
class Calibration:
    """``(temperature, scale)`` for every layer, or one pair per layer in ``per_layer``."""

    temperature: float = 1.0
    scale: float = 1.0
    per_layer: tuple[tuple[float, float], ...] | None = None

    def __post_init__(self) -> None:
        pairs = [(self.temperature, self.scale), *(self.per_layer or ())]
        if any(t <= 0 or s <= 0 for t, s in pairs):
            msg = f"calibration temperatures and scales must be positive, got {self}"
            raise PCRagError(msg)

    def at(self, layer: int) -> tuple[float, float]:
        """``(T, S)`` of decoder layer ``layer``."""
        return self.per_layer[layer] if self.per_layer is not None else (self.temperature, self.scale)

    @property
    def is_identity(self) -> bool:
        return all(p == (1.0, 1.0) for p in [(self.temperature, self.scale), *(self.per_layer or ())])

    def save(self, path: str | Path, fingerprint: str) -> None:
        body = {"format": FORMAT, "fingerprint": fingerprint, "temperature": self.temperature, "scale": self.scale}
        body["per_layer"] = [list(p) for p in self.per_layer] if self.per_layer is not None else None
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path, fingerprint: str) -> Calibration:
        """Read a calibration saved for the model with ``fingerprint``; ``PCRagError`` otherwise."""
        try:
            body = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            msg = f"cannot read calibration {path}: {e}"
            raise PCRagError(msg) from e
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            msg = f"{path} is not a pc-rag calibration (expected format {FORMAT!r})"
            raise PCRagError(msg)
        if body.get("fingerprint") != fingerprint:
            msg = f"calibration {path} was fitted for model {body.get('fingerprint')}, not {fingerprint}"
            raise PCRagError(msg)
        try:
            layers = body.get("per_layer")
            per_layer = tuple((float(t), float(s)) for t, s in layers) if layers is not None else None
            return cls(float(body["temperature"]), float(body["scale"]), per_layer)
        except (KeyError, TypeError, ValueError) as e:
            msg = f"calibration {path} is malformed: {e}"
            raise PCRagError(msg) from e


@dataclass(frozen=True)
class Segments:
    """Where a request's stale chunk keys are: cache indices ``[start, end)`` minus the recomputed ones.

    The first ``exact_rows`` query rows of a forward (recomputed chunk tokens, which run before the
    question in the same forward) attend exactly; the rows after them (the question, decode steps) are
    calibrated.
    """

    start: int
    end: int
    calibration: Calibration
    exact_rows: int = 0
    recomputed: torch.Tensor | None = None  # [R] cache indices inside [start, end) that were recomputed

    _masks: dict[tuple[int, torch.device], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def stale_mask(self, total: int, device: torch.device) -> torch.Tensor:
        """Bool [total]: True for stale chunk keys (made once per forward, shared by its layers)."""
        key = (total, torch.device(device))
        if key not in self._masks:
            mask = torch.zeros(total, dtype=torch.bool, device=device)
            mask[self.start : self.end] = True
            if self.recomputed is not None and self.recomputed.numel():
                mask[self.recomputed.to(device)] = False
            self._masks.clear()  # a decode step's keys are one longer than the last: keep only the newest
            self._masks[key] = mask
        return self._masks[key]


def calibrated_attention(
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,  # [B, H_kv, S, D]
    allowed: torch.Tensor,  # [B, 1, Q, S] bool: what each query may attend to
    stale: torch.Tensor,  # [S] bool: stale chunk keys
    scaling: float,
    temperature: float,
    scale: float,
) -> torch.Tensor:
    """APE attention of ``query`` rows; returns [B, Q, H, D] (transformers' attention output layout)."""
    batch, heads, q_len, dim = query.shape
    scores, allowed = packed_scores(query, key, scaling, allowed)
    in_chunks = allowed & stale
    chunk_scores = (scores / temperature).masked_fill(~in_chunks, float("-inf"))
    lse = torch.logsumexp(chunk_scores, dim=-1, keepdim=True)  # -inf where a row sees no stale key
    shift = torch.where(torch.isfinite(lse), (scale * temperature - 1) * lse, torch.zeros_like(lse))
    adjusted = torch.where(in_chunks, chunk_scores + shift, scores)  # scores are -inf where not allowed
    out = torch.softmax(adjusted, dim=-1).to(value.dtype) @ value  # [B, H_kv, n_rep*Q, D]
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous()


def packed_scores(
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    scaling: float,
    allowed: torch.Tensor,  # [B or 1, 1, Q, S] bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float scores [B, H_kv, n_rep*Q, S] of the query heads folded per KV head (row r * Q + q is query q of
    head g * n_rep + r), -inf where not ``allowed``, and ``allowed`` packed the same way [B, 1, n_rep*Q, S]."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    n_rep = heads // kv_heads
    q = query.reshape(batch, kv_heads, n_rep * q_len, dim)
    allowed = allowed.expand(batch, 1, q_len, -1)[:, :, None].expand(-1, -1, n_rep, -1, -1)
    allowed = allowed.reshape(batch, 1, n_rep * q_len, -1)
    scores = (q @ key.transpose(-1, -2)).float() * scaling
    return scores.masked_fill(~allowed, float("-inf")), allowed


def trailing_rows_mask(rows: int, keys: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """Bool [1, 1, rows, keys]: the last ``rows`` queries, whose own keys are the last ``rows`` keys, see keys
    up to their own (and, with a sliding ``window``, fewer than ``window`` back)."""
    query_index = torch.arange(keys - rows, keys, device=device)[:, None]
    key_index = torch.arange(keys, device=device)[None, :]
    allowed = key_index <= query_index
    if window is not None:
        allowed &= query_index - key_index < window
    return allowed[None, None]
