"""Checks and sizes of chunk spans (``SpanKV``) as the KV stores take and cache them; knows nothing about files."""

from __future__ import annotations

import operator

import torch

from pc_rag.kv import SpanKV


def well_shaped(keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> bool:
    # keys, values: [L, H_kv, S, D]; positions: [S]
    return keys.dim() == 4 and keys.shape == values.shape and positions.shape == (keys.shape[2],)


def span_bytes(span: SpanKV) -> int:
    """What a decoded span holds in memory: its keys, values and positions."""
    return span.nbytes + span.positions.nbytes


def check_span(chunk_id: int, span: SpanKV) -> int:
    """``chunk_id`` as an int (``TypeError`` if it is not an integer), after checking it and the span's shapes."""
    cid = operator.index(chunk_id)
    if cid < 0:
        msg = f"chunk ids must be non-negative, got {cid}"
        raise ValueError(msg)
    if not well_shaped(span.keys, span.values, span.positions):
        shapes = ", ".join(str(tuple(t.shape)) for t in (span.keys, span.values, span.positions))
        msg = f"chunk {cid}: keys/values must be [L, H_kv, S, D] of one shape and positions [S]; got {shapes}"
        raise ValueError(msg)
    return cid
