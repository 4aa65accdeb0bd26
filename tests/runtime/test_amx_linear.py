"""The AMX kernel of quantized layers (csrc/amx_linear.cpp) against the dense weights prefill multiplies.

The kernel runs where the CPU has AMX (Intel Sapphire Rapids and later); elsewhere those tests skip, and the
layout test (pure torch) still runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pc_rag.runtime.cpu_kernels import AMX_SWITCH, amx_layers, amx_linear
from pc_rag.weights import Int4Linear, Int8Linear, amx_pack

needs_amx = pytest.mark.skipif(amx_linear() is None, reason="this CPU or process has no AMX")

SHAPES = [(16, 32), (48, 96), (960, 576), (576, 1536)]


def _unpacked(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """amx_pack's inverse, from its documented layout: [out, in]."""
    blocks, steps, lines, _ = packed.shape
    elements = torch.cat([packed & 15, packed >> 4], dim=-1) if bits == 4 else packed
    q = elements.view(blocks, steps, lines, 16, 2).permute(0, 3, 1, 2, 4)  # [block, output, step, pair, 2]
    return q.reshape(blocks * 16, steps * 32)


def _layers(out_features: int, in_features: int) -> tuple[Int4Linear, Int8Linear]:
    torch.manual_seed(out_features + in_features)
    linear = nn.Linear(in_features, out_features, bias=False)
    return Int4Linear.quantize(linear, torch.bfloat16), Int8Linear.quantize(linear, torch.bfloat16)


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_the_pack_holds_every_weight_where_its_layout_says(out_features: int, in_features: int) -> None:
    int4, int8 = _layers(out_features, in_features)
    assert torch.equal(_unpacked(amx_pack(int4.q, 4), 4), int4.q)
    assert torch.equal(_unpacked(amx_pack(int8.qweight, 8), 8), int8.qweight)


@needs_amx
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_the_kernel_multiplies_by_the_dense_weight_bit_for_bit(out_features: int, in_features: int) -> None:
    """Unit rows pick single weights: the kernel's dequantized weight is the dense copy's, every bit."""
    kernel = amx_linear()
    assert kernel is not None
    eye = torch.eye(in_features, dtype=torch.bfloat16)
    for layer, packed, scales, bits in [
        (int4 := _layers(out_features, in_features)[0], amx_pack(int4.q, 4), int4.scales_and_zeros, 4),
        (int8 := _layers(out_features, in_features)[1], amx_pack(int8.qweight, 8), int8.scales, 8),
    ]:
        rows = [eye[i : i + 16].contiguous() for i in range(0, in_features, 16)]
        columns = torch.cat([kernel(unit, packed, scales, bits) for unit in rows])
        assert torch.equal(columns.T, layer.weight), f"int{bits}"


@needs_amx
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gets_its_own_bits_among_any_number_of_rows(bits: int) -> None:
    int4, int8 = _layers(960, 576)
    layer = int4 if bits == 4 else int8
    packed = amx_pack(int4.q, 4) if bits == 4 else amx_pack(int8.qweight, 8)
    scales = int4.scales_and_zeros if bits == 4 else int8.scales
    kernel = amx_linear()
    assert kernel is not None
    x = torch.randn(37, 576).to(torch.bfloat16)
    together = kernel(x, packed, scales, bits)
    for count in (1, 2, 3, 4, 16, 17):
        assert torch.equal(kernel(x[:count].contiguous(), packed, scales, bits), together[:count])
    reference = x.float() @ layer.weight.float().T  # float32 sums of exact products: only the order differs
    torch.testing.assert_close(together.float(), reference, rtol=1e-2, atol=1e-2)


def test_the_switch_names_the_layers_on_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AMX_SWITCH, raising=False)
    assert amx_layers() == ()
    monkeypatch.setenv(AMX_SWITCH, "int8")
    assert amx_layers() == (8,)
    monkeypatch.setenv(AMX_SWITCH, "yes")
    with pytest.raises(ValueError, match="PC_RAG_AMX='yes': expected one of 0, int8, all"):
        amx_layers()


def test_by_default_quantized_layers_stay_off_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(AMX_SWITCH, raising=False)
    int4, int8 = _layers(960, 576)
    assert int4.kernel_tensors()[0].dim() != 4 and int8.kernel_tensors()[0].dim() != 4  # type: ignore[index]


@needs_amx
def test_quantized_layers_take_the_amx_kernel_for_decode_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(AMX_SWITCH, "all")
    int4, int8 = _layers(960, 576)
    x = torch.randn(3, 576).to(torch.bfloat16)
    for layer in (int4, int8):
        tensors = layer.kernel_tensors()
        assert tensors is not None and tensors[0].dim() == 4
        assert torch.equal(layer(x), amx_linear()(x, *tensors, 4 if layer is int4 else 8))  # type: ignore[misc]
