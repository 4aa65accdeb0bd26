"""A merged splice adapter's low-rank term on a quantized kernel's rows: ``LowRankTerm``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pc_rag.runtime.cpu_kernels import low_rank_term
from pc_rag.weights import KERNEL_ROWS


@dataclass(frozen=True)
class LowRankTerm:
    """``fix(out, x)``: ``out`` (a quantized kernel's rows for ``x``, at most ``KERNEL_ROWS``) plus ``b @ a``
    applied to ``x``, as a merged splice adapter adds it to a layer's kernel rows. ``a`` [r, in], ``b`` [out, r]
    (scale included), float32.

    A row must get the same bits in a step of 1 row as of ``KERNEL_ROWS`` (batched decoding equals decoding alone,
    as the kernel gives it). Where the CPU kernels are built (``cpu_kernels``) the term is one call of
    ``csrc/low_rank.cpp``: each row's dot products in a fixed order of its own, also inside the native layers'
    loop (``native_layers``). Without them it is computed over ``KERNEL_ROWS`` rows (``x``'s, then zeros) as
    products summed within each row: same shapes, same reductions, whatever the row count (AVX2's reductions over
    few elements differ by output count). The two round differently: a machine runs one of them for every step."""

    a: torch.Tensor
    b: torch.Tensor

    def __call__(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if out.device.type == "cpu" and out.dtype == torch.bfloat16 and (kernel := low_rank_term()) is not None:
            return kernel(out, x, self.a, self.b)
        rows = x.reshape(-1, x.shape[-1]).float()
        padded = F.pad(rows, (0, 0, 0, KERNEL_ROWS - rows.shape[0]))  # [KERNEL_ROWS, in]
        low = (padded.unsqueeze(1) * self.a).sum(-1)  # [KERNEL_ROWS, r]
        term = (low.unsqueeze(1) * self.b).sum(-1)[: rows.shape[0]]  # [rows, out]
        return (out.float() + term.view(out.shape)).to(out.dtype)
