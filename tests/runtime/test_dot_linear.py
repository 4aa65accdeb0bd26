"""The dot-product kernel of quantized layers (csrc/dot_linear.cpp) against the quantized weight's exact product.

The kernel runs where the CPU has AVX-512 BF16 (Zen 4, Intel Cooper Lake and later); elsewhere those tests skip,
and the layout tests (pure torch) still run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pc_rag.runtime.cpu_kernels import DOT_SWITCH, dot_linear, dot_on
from pc_rag.weights import FusedKernel, Int4Linear, Int8Linear, dot_pack, dot_scales

needs_dot = pytest.mark.skipif(dot_linear() is None, reason="this CPU has no AVX-512 BF16")

SHAPES = [(16, 32), (48, 96), (960, 576), (576, 1536)]


def _layers(out_features: int, in_features: int) -> tuple[Int4Linear, Int8Linear]:
    torch.manual_seed(out_features + in_features)
    linear = nn.Linear(in_features, out_features, bias=False)
    return Int4Linear.quantize(linear, torch.bfloat16), Int8Linear.quantize(linear, torch.bfloat16)


def _unpacked(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """dot_pack's inverse, from its documented layout: [out, in]."""
    blocks, groups, _ = packed.shape
    if bits == 4:
        chunks = packed.view(blocks, groups, 8, 32)
        pairs = torch.stack([chunks & 15, chunks >> 4], dim=3).view(blocks, groups, 16, 32)
    else:
        pairs = packed.view(blocks, groups, 16, 32)
    q = pairs.view(blocks, groups, 16, 16, 2).permute(0, 3, 1, 2, 4)  # [block, output, group, pair, 2]
    return q.reshape(blocks * 16, groups * 32)


def _exact(layer: Int4Linear | Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """``x`` times the quantized weight in float64, from ``q`` and the scales (no dequantized copy)."""
    if isinstance(layer, Int8Linear):
        return x.double() @ (layer.qweight.double() * layer.scales.double()[:, None]).T
    scales, zeros = layer.scales_and_zeros.double().unbind(-1)  # [groups, out]
    out_features, in_features = layer.q.shape
    groups = layer.q.double().view(out_features, -1, 32) - 8
    weight = groups * scales.T[..., None] + zeros.T[..., None]
    return x.double() @ weight.view(out_features, in_features).T


def _call(layer: Int4Linear | Int8Linear, x: torch.Tensor) -> torch.Tensor:
    kernel = dot_linear()
    assert kernel is not None
    if isinstance(layer, Int8Linear):
        return kernel(x, dot_pack(layer.qweight, 8), layer.scales, 8)
    return kernel(x, dot_pack(layer.q, 4), dot_scales(layer.scales_and_zeros), 4)


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_the_pack_holds_every_weight_and_scale_where_its_layout_says(out_features: int, in_features: int) -> None:
    int4, int8 = _layers(out_features, in_features)
    assert torch.equal(_unpacked(dot_pack(int4.q, 4), 4), int4.q)
    assert torch.equal(_unpacked(dot_pack(int8.qweight, 8), 8), int8.qweight)
    blocks = dot_scales(int4.scales_and_zeros)  # [out / 16, in / 32, 16 scales then 16 zeros]
    scales = blocks[..., :16].permute(1, 0, 2).reshape(in_features // 32, out_features)
    zeros = blocks[..., 16:].permute(1, 0, 2).reshape(in_features // 32, out_features)
    assert torch.equal(torch.stack([scales, zeros], dim=-1), int4.scales_and_zeros)


@needs_dot
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
@pytest.mark.parametrize("bits", [4, 8])
def test_the_kernel_rounds_the_exact_product_once_to_bfloat16(out_features: int, in_features: int, bits: int) -> None:
    """float32 sums of exact products, then one rounding: every output within one bfloat16 step of the exact
    product, nearly all of them its nearest bfloat16. A misplaced weight, scale or zero is off by far more."""
    int4, int8 = _layers(out_features, in_features)
    layer = int4 if bits == 4 else int8
    x = torch.randn(7, in_features).to(torch.bfloat16)
    got, exact = _call(layer, x).double(), _exact(layer, x)
    step = exact.abs().clamp(min=exact.abs().max().item() * 2**-16) * 2**-7  # a bfloat16 step (7 stored bits)
    assert ((got - exact).abs() <= step).all()
    nearest = exact.float().to(torch.bfloat16).double()
    assert (got == nearest).double().mean() > 0.99


@needs_dot
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gets_its_own_bits_among_any_number_of_rows_and_threads(bits: int) -> None:
    int4, int8 = _layers(960, 576)
    layer = int4 if bits == 4 else int8
    x = torch.randn(17, 576).to(torch.bfloat16)
    together = _call(layer, x)
    for count in (1, 2, 3, 4, 5, 8):
        assert torch.equal(_call(layer, x[:count].contiguous()), together[:count])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_call(layer, x), together)
    finally:
        torch.set_num_threads(threads)


@needs_dot
def test_quantized_layers_take_the_kernel_for_decode_rows_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DOT_SWITCH, raising=False)
    int4, int8 = _layers(960, 576)
    x = torch.randn(3, 576).to(torch.bfloat16)
    for layer in (int4, int8):
        tensors = layer.kernel_tensors()
        assert tensors is not None and tensors[0].dim() == 3
        assert torch.equal(layer(x), _call(layer, x))
    qkv = [int4, *_layers(192, 576)[:1], *_layers(192, 576)[:1]]
    fused = FusedKernel.of(qkv)
    assert fused is not None and fused.tensors[0].dim() == 3
    for part, layer in zip(fused(x), qkv, strict=True):
        assert torch.equal(part, layer(x))


def test_the_switch_keeps_atens_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DOT_SWITCH, "0")
    assert not dot_on()
    int4, int8 = _layers(960, 576)
    assert int4.kernel_tensors()[0].dim() == 2 and int8.kernel_tensors()[0].dim() == 2  # type: ignore[index]
    monkeypatch.setenv(DOT_SWITCH, "yes")
    with pytest.raises(ValueError, match="PC_RAG_DOT_LINEAR='yes': expected 0 or 1"):
        dot_on()


@needs_dot
def test_bad_blocks_get_a_precise_error() -> None:
    int4, _ = _layers(960, 576)
    kernel = dot_linear()
    assert kernel is not None
    x = torch.randn(2, 1536).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="int4 blocks of 576 inputs for rows of 1536"):
        kernel(x, dot_pack(int4.q, 4), dot_scales(int4.scales_and_zeros), 4)
    with pytest.raises(RuntimeError, match="bits must be 4 or 8, got 5"):
        kernel(x[:, :576].contiguous(), dot_pack(int4.q, 4), dot_scales(int4.scales_and_zeros), 5)
