"""Attention of a step's rows in one call, with bits that do not depend on where the step starts.

A verify step attends its rows (the fed token and its drafts) to the cache. One flash call per row (the plain
step's ``cache_attention``) costs a call per row: in int4 at 4K tokens a 4-row step's attention took 65.8 ms
against 25.4 ms for one row. One call for all rows must still give each row the bits it gets alone, or
speculation would not equal plain decoding; but a flash call's bits depend on its shape: the number of keys it
reduces over (the kernel's blocks, its vector loops' tails) and, on AVX2, the number of query rows (the GEMM
kernel is chosen by it). So each row attends as a batch entry of its own, in a call of fixed per-entry shape:

- keys: the cache up to the end of the row's bucket of ``BUCKET`` slots (``bucket_end``), masked past the row's
  own slot; the step zeroes the slots past its tokens first (masked out, a NaN left in memory would still poison
  the sums: 0 times NaN is NaN); the cache is expanded over the batch, not copied;
- queries: the row's own heads, as in the one-row call.

A row at slot p then gets the same bits as the fed token, as a draft, alone or beside others (a flash call
computes each batch entry and head on its own). Rows on both sides of a bucket boundary take one call per
bucket (at most two). A plain one-row step attends this way too where speculation must equal it bit for bit.
This module knows nothing about models beyond the attention tensors it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pc_rag.attention import FLASH_CPU
from pc_rag.runtime.arena import CAPACITY_STEP

BUCKET = CAPACITY_STEP
"""Key slots per bucket: the private arena's capacity step, a multiple of every CPU vector width."""


def bucket_end(slot: int) -> int:
    """Keys a row at cache slot ``slot`` attends over: through the end of its bucket."""
    return -(-(slot + 1) // BUCKET) * BUCKET


@dataclass(frozen=True)
class _Call:
    first: int  # the step rows first..first+count-1 attend in this call, one batch entry each
    count: int
    end: int  # keys 0..end-1
    mask: torch.Tensor  # [count, 1, 1, end] additive: 0 through each row's own slot, -inf past it


class BucketedAttention:
    """The calls of one step: ``count`` rows at slots ``length, length + 1, ...``. Built once per step and
    applied in every layer."""

    def __init__(self, length: int, count: int, dtype: torch.dtype, device: torch.device) -> None:
        assert count > 0, "a step attends at least one row"
        self.end = bucket_end(length + count - 1)
        self._calls: list[_Call] = []
        first = 0
        while first < count:
            end = bucket_end(length + first)
            members = [t for t in range(first, count) if bucket_end(length + t) == end]
            own = torch.tensor([length + t for t in members], device=device)
            visible = torch.arange(end, device=device)[None, :] <= own[:, None]  # [count, end]
            mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
            self._calls.append(_Call(first, len(members), end, mask[:, None, None, :]))
            first += len(members)

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """``q`` [R, H, 1, D] (the step's rows), ``keys``/``values`` [1, H_kv, capacity, D] holding the step's
        keys and values and zeros up to ``end``; returns the attention of the step's real rows [count, 1, H * D]."""
        kv_heads, head_dim = keys.shape[1], q.shape[-1]
        outs = []
        for call in self._calls:
            folded = q[call.first : call.first + call.count].reshape(call.count, kv_heads, -1, head_dim)
            k = keys[:, :, : call.end].expand(call.count, -1, -1, -1)  # one batch entry per row, the cache not copied
            v = values[:, :, : call.end].expand(call.count, -1, -1, -1)
            if FLASH_CPU is not None and q.device.type == "cpu":
                out = FLASH_CPU(folded, k, v, attn_mask=call.mask, scale=scale)[0]
            else:
                out = F.scaled_dot_product_attention(folded, k, v, attn_mask=call.mask, scale=scale)
            outs.append(out.reshape(call.count, 1, -1))
        return outs[0] if len(outs) == 1 else torch.cat(outs)
