"""A merged adapter's low-rank term on kernel rows: near the exact product, and a row's bits its own."""

from __future__ import annotations

import pytest
import torch

from pc_rag.runtime import cpu_kernels
from pc_rag.runtime.low_rank import LowRankTerm


def _inputs(rows: int, seed: int = 0, width: int = 96, rank: int = 8, features: int = 72):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 1, features, generator=generator).bfloat16()
    out = torch.randn(rows, 1, width, generator=generator).bfloat16()
    a = torch.randn(rank, features, generator=generator) * 0.3
    b = torch.randn(width, rank, generator=generator) * 0.3
    return out, x, a, b


@pytest.fixture(params=["cpu kernel", "aten"])
def term_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test through the kernel (``csrc/low_rank.cpp``) and the ATen formula machines without it use."""
    if request.param == "aten":
        monkeypatch.setattr(cpu_kernels, "_LOADED", [None])
    elif cpu_kernels.low_rank_term() is None:
        pytest.skip("the CPU kernels do not run here")
    return str(request.param)


def test_the_term_is_the_exact_product_rounded_once(term_path: str) -> None:
    out, x, a, b = _inputs(3)
    got = LowRankTerm(a, b)(out, x)
    exact = out.double() + (x.double().reshape(3, -1) @ a.double().T @ b.double().T).view(out.shape)
    assert got.dtype == torch.bfloat16 and got.shape == out.shape
    assert torch.allclose(got.double(), exact, rtol=1e-2, atol=1e-2)


def test_a_row_gets_its_bits_alone_or_beside_others(term_path: str) -> None:
    out, x, a, b = _inputs(4, seed=1)
    term = LowRankTerm(a, b)
    together = term(out, x)
    for row in range(4):
        assert torch.equal(term(out[row : row + 1], x[row : row + 1]), together[row : row + 1])


def test_the_kernel_refuses_mismatched_rows() -> None:
    kernel = cpu_kernels.low_rank_term()
    if kernel is None:
        pytest.skip("the CPU kernels do not run here")
    out, x, a, b = _inputs(2)
    with pytest.raises(RuntimeError, match="must hold the same rows"):
        kernel(out, x[:1], a, b)
    with pytest.raises(RuntimeError, match="must be float32"):
        kernel(out, x, a.double(), b)
