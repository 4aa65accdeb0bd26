"""FlexAttention with log-sum-exp (the GPU's kernel for the passes of two-phase attention) equals the matmul
reference, for a mask per row, one mask for all rows, and none; uncompiled here, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from pc_rag.runtime.flex_attention import flex_with_lse
from pc_rag.runtime.partition_attention import _attend_matmul, private_mask


@pytest.mark.parametrize("masking", ["per-row", "shared", "none"])
def test_flex_equals_the_matmul_reference(masking: str) -> None:
    g = torch.Generator().manual_seed(0)
    batch, kv_heads, queries, keys, dim = 3, 2, 4, 40, 16
    q, k, v = (torch.randn(batch, kv_heads, n, dim, generator=g) for n in (queries, keys, keys))
    mask = {
        "per-row": private_mask(torch.tensor([40, 17, 5]), keys, torch.float32)[:, None, None, :],
        "shared": private_mask(torch.tensor([33]), keys, torch.float32)[:, None, None, :],
        "none": None,
    }[masking]
    out, lse = flex_with_lse(q, k, v, mask, 0.25, compiled=False)
    expected_out, expected_lse = _attend_matmul(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel needs a GPU")
def test_the_compiled_kernel_equals_the_reference_on_cuda() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(8, 4, n, 64, generator=g, device="cuda", dtype=torch.bfloat16) for n in (3, 300, 300))
    mask = private_mask(torch.randint(1, 300, (8,), device="cuda"), 300, torch.float32)[:, None, None, :]
    out, lse = flex_with_lse(q, k, v, mask, 0.125)
    expected_out, expected_lse = _attend_matmul(q, k, v, mask, 0.125)
    torch.testing.assert_close(out.float(), expected_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-3, atol=1e-3)
