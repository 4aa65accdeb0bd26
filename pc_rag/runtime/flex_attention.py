"""Attention with each query's log-sum-exp through PyTorch's FlexAttention: one fused kernel per pass on a GPU.

The two passes of two-phase attention (``partition_attention``) each need their output and their queries'
log-sum-exp, which the merge weighs them by. On CUDA ``flex_attention`` compiled by inductor (Triton) is that
kernel, with the additive mask read inside it as a ``score_mod``; uncompiled, the same call runs PyTorch's
reference implementation, which is how the CPU tests check it. This module knows nothing about shared runs or
batches: it receives tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.attention.flex_attention import flex_attention

_COMPILED: Callable[..., Any] | None = None
_LOCK = threading.Lock()


def compiled_flex() -> Callable[..., Any]:
    """``flex_attention`` compiled once per process (dynamic shapes: run lengths change every request)."""
    global _COMPILED
    with _LOCK:
        if _COMPILED is None:
            _COMPILED = torch.compile(flex_attention, dynamic=True)
        return _COMPILED


def flex_with_lse(
    query: torch.Tensor,  # [B, H_kv, Q, D]
    keys: torch.Tensor,  # [B, H_kv, S, D]
    values: torch.Tensor,  # [B, H_kv, S, D]
    mask: torch.Tensor | None,  # additive [B or 1, 1, 1, S], or None
    scale: float,
    compiled: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [B, H_kv, Q, D] (the query's dtype) and log-sum-exp [B, H_kv, Q] (float32) of each query's scores."""
    score_mod = None
    if mask is not None:
        assert mask.dim() == 4 and mask.shape[1] == mask.shape[2] == 1, f"a key mask per row, got {tuple(mask.shape)}"
        rows = mask.reshape(mask.shape[0], -1).float().expand(query.shape[0], -1)  # [B, S], one mask per row

        def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor):
            return score + rows[b, kv]

    attend = compiled_flex() if compiled else flex_attention
    out, lse = attend(query, keys, values, score_mod=score_mod, scale=scale, return_lse=True)
    return out, lse.float()
