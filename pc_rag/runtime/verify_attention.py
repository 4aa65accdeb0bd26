"""Attention of a speculative step's rows in one call, with bits that do not depend on where the step starts.

A verify step attends its rows (the fed token and its drafts) to the cache. One flash call per row (the plain
step's ``cache_attention``) reads the cache once per row: at 4K tokens that made a 4-row step's attention 2.6x a
one-row step's. One call for all rows reads it once, but a row's bits then depend on the call's shape: the number
of keys reduced over (the kernel's blocks, its vector loops' tails) and, on AVX2, the number of query rows (the
GEMM kernel is chosen by it). So each row of a speculative request attends in a call whose shape is a function of
its own slot only:

- keys: the cache up to the end of the row's bucket of ``BUCKET`` slots (``bucket_end``), masked past the row's
  own slot; the step zeroes the slots past its tokens first (masked out, a NaN left in memory would still poison
  the sums: 0 times NaN is NaN);
- queries: ``STEP_ROWS`` rows, the step's rows padded by repeating the first, so the kernel sees one row count.

A row at slot p then gets the same bits in any step that computes it: as the fed token, as a draft, alone. Rows
on both sides of a bucket boundary take one call per bucket (at most two). This module knows nothing about
models beyond the attention tensors it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pc_rag.attention import FLASH_CPU

BUCKET = 64
"""Key slots per bucket: a multiple of every CPU vector width (8 floats on AVX2, 16 on AVX-512)."""


def bucket_end(slot: int) -> int:
    """Keys a row at cache slot ``slot`` attends over: through the end of its bucket."""
    return -(-(slot + 1) // BUCKET) * BUCKET


@dataclass(frozen=True)
class _Call:
    first: int  # the step rows first..first+count-1 attend in this call
    count: int
    index: torch.Tensor  # [rows] the step rows the call's query rows take (padded with ``first``)
    end: int  # keys 0..end-1
    mask: torch.Tensor  # [rows * n_rep, end] additive: 0 through each row's own slot, -inf past it


class BucketedAttention:
    """The calls of one step: ``count`` rows at slots ``length, length + 1, ...``, each call ``rows`` query rows of
    ``n_rep`` heads per KV head. Built once per step and applied in every layer."""

    def __init__(
        self, length: int, count: int, rows: int, n_rep: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        assert 0 < count <= rows, f"{count} rows in a call of {rows}"
        self.end = bucket_end(length + count - 1)
        self._calls: list[_Call] = []
        first = 0
        while first < count:
            end = bucket_end(length + first)
            members = [t for t in range(first, count) if bucket_end(length + t) == end]
            index = [*members, *[first] * (rows - len(members))]
            own = torch.tensor([length + t for t in index], device=device).repeat_interleave(n_rep)
            visible = torch.arange(end, device=device)[None, :] <= own[:, None]
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            self._calls.append(_Call(first, len(members), torch.tensor(index, device=device), end, mask))
            first += len(members)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """``q`` [R, H, 1, D] (the step's rows), ``keys``/``values`` [1, H_kv, capacity, D] holding the step's
        keys and values and zeros up to ``end``; returns the attention of the step's real rows [count, 1, H * D]."""
        kv_heads, head_dim = keys.shape[1], q.shape[-1]
        outs = []
        for call in self._calls:
            rows = len(call.index)
            folded = q[call.index].reshape(rows, kv_heads, -1, head_dim).transpose(0, 1)
            folded = folded.reshape(1, kv_heads, -1, head_dim)  # [1, H_kv, rows * n_rep, D], row-major
            k, v = keys[:, :, : call.end], values[:, :, : call.end]
            if FLASH_CPU is not None and q.device.type == "cpu":
                out = FLASH_CPU(folded, k, v, attn_mask=call.mask, scale=scale)[0]
            else:
                out = F.scaled_dot_product_attention(folded, k, v, attn_mask=call.mask, scale=scale)
            out = out.reshape(kv_heads, rows, -1, head_dim).transpose(0, 1).reshape(rows, 1, -1)
            outs.append(out[: call.count])
        return outs[0] if len(outs) == 1 else torch.cat(outs)
