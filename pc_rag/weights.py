"""Compute dtypes for serving: dense float32 / bfloat16, and weight-only int8 / int4 linear layers.

Decoding one token reads every weight once, so its speed is the weights' size over the memory
bandwidth. ``int8`` keeps one int8 per weight and a scale per output channel; ``int4`` keeps 4 bits
per weight with a scale and zero per group of 32 inputs (min-max, asymmetric): the layout of
GGUF's Q4_1, so a model dequantized from Q4_1 (the bundled SmolLM2) gets its own 4-bit weights back,
not a second rounding. The output projection stays int8 in ``int4`` (GGUF keeps it at 8 bits too).
Quantized layers compute in bfloat16. A decode step (a few rows) reads the small weights: on a CPU with AVX-512
BF16 through pc-rag's dot-product kernel (``runtime/csrc/dot_linear.cpp``, ``PC_RAG_DOT_LINEAR``), with
``PC_RAG_AMX`` on a CPU with AMX through its tile kernel (``runtime/csrc/amx_linear.cpp``), elsewhere through
PyTorch's fused CPU kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``); many rows
(prefill, recompute, encoding) multiply a dense bfloat16 copy of the same dequantized weight, where
the GEMM is compute-bound and those kernels are slow. So they save decode bandwidth, not memory. Off
the CPU every call takes the dense copy: correct, not faster (no GPU was lent to test a GPU kernel).
This module knows nothing about caches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pc_rag.errors import ModelLoadError

INT4_GROUP = 32


@dataclass(frozen=True)
class ComputeDtype:
    """How a model computes: the activations' (and KV's) dtype and the linear layers' weight format."""

    name: str
    activations: torch.dtype
    linear: str | None = None  # None: dense weights in ``activations``; "int8" or "int4": weight-only quantized

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.activations


COMPUTE_DTYPES = {
    "float32": ComputeDtype("float32", torch.float32),
    "bfloat16": ComputeDtype("bfloat16", torch.bfloat16),
    "int8": ComputeDtype("int8", torch.bfloat16, "int8"),
    "int4": ComputeDtype("int4", torch.bfloat16, "int4"),
}
_ALIASES = {"fp32": "float32", "bf16": "bfloat16", str(torch.float32): "float32", str(torch.bfloat16): "bfloat16"}


def compute_dtype(name: str | torch.dtype | ComputeDtype) -> ComputeDtype:
    """The compute dtype called ``name`` (``float32``, ``bfloat16``, ``int8``, ``int4``, or a torch dtype)."""
    if isinstance(name, ComputeDtype):
        return name
    key = _ALIASES.get(str(name), str(name))
    if key not in COMPUTE_DTYPES:
        msg = f"unknown compute dtype {name!r}; choose one of {', '.join(COMPUTE_DTYPES)}"
        raise ModelLoadError(msg)
    return COMPUTE_DTYPES[key]


def apply_compute_dtype(model: nn.Module, compute: ComputeDtype) -> nn.Module:
    """Cast ``model`` to ``compute.activations`` and, for int8/int4, replace its linear layers in place."""
    if compute.linear is None:
        return model.to(compute.activations)
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        parent, _, attr = name.rpartition(".")
        if compute.linear == "int4" and linear is not output and linear.in_features % INT4_GROUP == 0:
            quantized: nn.Module = Int4Linear.quantize(linear, compute.activations)
        else:
            quantized = Int8Linear.quantize(linear, compute.activations)
        setattr(model.get_submodule(parent) if parent else model, attr, quantized)
    return model.to(compute.activations)  # norms, embeddings and biases; quantized buffers keep their dtypes


def _native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX); without it oneDNN emulates a
    bfloat16 GEMM at about a third of float32's speed (2-core Cascade Lake: 91 against 30 ms for 1,500 x 576 x
    1,536)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


NATIVE_BFLOAT16 = _native_bfloat16()


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``; for bfloat16 on a CPU without bfloat16 arithmetic, computed in float32 and rounded once to
    bfloat16. The products of bfloat16 values are exact in float32 and a bfloat16 GEMM accumulates in float32
    too, so only the order of the sums differs; prefill runs about 3x faster there."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or NATIVE_BFLOAT16:
        return F.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


# Up to this many rows (decoding) the fused kernels win; beyond, the dense GEMM does. The two paths round
# differently, so a batched step's row gets the bits it gets alone only while both have at most this many rows
# (runtime.batch_step)
KERNEL_ROWS = 4


class QuantizedLinear(nn.Module, ABC):
    """A linear layer whose weight is stored quantized for reading few rows (decode steps) fast.

    ``weight`` holds the dequantized weight in the activations' dtype for many rows at once (prefill,
    recompute), where the GEMM is compute-bound and the fused kernels are slow: memory buys prefill speed.
    Both paths apply the same quantized weight. A subclass names its CPU kernel (``matmul``), the
    tensors it reads (``kernel_tensors``) and how those of several layers are joined (``joined``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    _blocks: tuple[str, tuple[torch.Tensor, ...]] | None = None  # (kernel, its blocks and scales), made on first use

    def _blocked_tensors(self, q: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...] | None:
        """``q`` and ``scales`` packed once for the blocked kernel this layer takes (``blocked_kernel``); else None."""
        kernel = blocked_kernel(q, bits)
        if kernel is None:
            return None
        if self._blocks is None or self._blocks[0] != kernel:
            self._blocks = (kernel, blocked_tensors(kernel, q, scales, bits))
        return self._blocks[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tensors = self.kernel_tensors() if self._kernel_rows(x) else None  # many rows never ask for the tensors
        if tensors is None:
            return dense_linear(x, self.weight, self.bias)
        return _kernel_call(type(self).matmul, tensors, self.bias, x)

    def takes_kernel(self, x: torch.Tensor) -> bool:
        """Whether ``forward(x)`` runs the fused kernel (at most ``KERNEL_ROWS`` bfloat16 rows on the CPU, where the
        kernel exists): a row's bits then do not depend on the other rows."""
        return self._kernel_rows(x) and self.kernel_tensors() is not None

    def _kernel_rows(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is rows a kernel takes: at most ``KERNEL_ROWS`` bfloat16 rows on the CPU."""
        rows = x.numel() // self.in_features
        return x.device.type == "cpu" and x.dtype == torch.bfloat16 and rows <= KERNEL_ROWS

    @staticmethod
    @abstractmethod
    def matmul(x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        """``x`` [rows, in] (bfloat16, CPU) times the weight the kernel tensors hold."""

    @abstractmethod
    def kernel_tensors(self) -> tuple[torch.Tensor, ...] | None:
        """What ``matmul`` reads; None where there is no kernel (off the CPU, or a shape it cannot take)."""

    @classmethod
    @abstractmethod
    def joined(cls, layers: Sequence[QuantizedLinear]) -> tuple[torch.Tensor, ...] | None:
        """The kernel tensors of ``layers`` (same input) stacked along the output: one call computes all."""


def _kernel_call(
    matmul: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...], bias: torch.Tensor | None, x: torch.Tensor
) -> torch.Tensor:
    out = matmul(x.reshape(-1, x.shape[-1]).contiguous(), *tensors)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], -1)


def _amx_kernel(bits: int) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
    """The AMX kernel where it runs here and ``PC_RAG_AMX`` puts int``bits`` layers on it (``cpu_kernels``)."""
    from pc_rag.runtime.cpu_kernels import amx_layers, amx_linear  # the runtime imports this module

    return amx_linear() if bits in amx_layers() else None


def _dot_kernel() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor] | None:
    """The dot-product kernel where it runs here and ``PC_RAG_DOT_LINEAR`` leaves it on (``cpu_kernels``)."""
    from pc_rag.runtime.cpu_kernels import dot_linear, dot_on

    return dot_linear() if dot_on() else None


def blocked_kernel(q: torch.Tensor, bits: int) -> str | None:
    """Which blocked kernel weights ``q`` take for decode rows: ``"amx"`` where ``PC_RAG_AMX`` asks for it,
    ``"dot"`` where the CPU has AVX-512 BF16, or None (ATen's fused kernels); only whole blocks of 16 outputs
    and 32 inputs on the CPU."""
    if q.device.type != "cpu" or q.shape[0] % 16 or q.shape[1] % 32:
        return None
    if _amx_kernel(bits) is not None:
        return "amx"
    return "dot" if _dot_kernel() is not None else None


def blocked_tensors(kernel: str, q: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """``kernel``'s tensors for weights ``q`` (int4: uint8 0..15, int8: int8) with their ``scales``."""
    if kernel == "amx":
        return amx_pack(q, bits), scales
    return dot_pack(q, bits), (dot_scales(scales) if bits == 4 else scales)


def _blocked_call(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` times blocked weights: AMX blocks have 4 dimensions (``amx_pack``), dot-product blocks 3 (``dot_pack``).
    The switches chose the pack; once packed, the weights run on its kernel."""
    from pc_rag.runtime.cpu_kernels import amx_linear, dot_linear

    name, kernel = ("AMX", amx_linear()) if packed.dim() == 4 else ("dot-product", dot_linear())
    if kernel is None:
        msg = f"int{bits} weights in {name} blocks, but the {name} kernel cannot run in this process"
        raise RuntimeError(msg)
    return kernel(x, packed, scales, bits)


def _pairs(q: torch.Tensor) -> torch.Tensor:
    """``q`` [out, in] as [out / 16, in / 32, 16 pairs, 32]: pair p's element e is output e // 2's input 2p + e % 2
    (a TDPBF16PS B row, a VDPBF16PS operand)."""
    out_features, in_features = q.shape
    elements = q.view(out_features // 16, 16, in_features // 32, 16, 2).permute(0, 2, 3, 1, 4)
    return elements.reshape(out_features // 16, in_features // 32, 16, 32)


def amx_pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``q`` [out, in] (int4: uint8 0..15, int8: int8) in ``csrc/amx_linear.cpp``'s blocks [out / 16, in / 32, 16
    lines, 16 (int4) or 32 (int8) bytes]: line p of a block is ``_pairs``' pair p; an int4 line's byte t holds
    elements t (low nibble) and t + 16 (high)."""
    elements = _pairs(q)
    if bits == 8:
        return elements.contiguous()
    return (elements[..., :16] | (elements[..., 16:] << 4)).contiguous()


def dot_pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """``q`` [out, in] (int4: uint8 0..15, int8: int8) in ``csrc/dot_linear.cpp``'s blocks [out / 16, in / 32,
    256 (int4) or 512 (int8) bytes]: int8 is ``_pairs``' 16 pairs in order; int4 is 8 chunks of 32 bytes, chunk j's
    byte e holding element e of pair 2j (low nibble) and of pair 2j + 1 (high)."""
    elements = _pairs(q)
    if bits == 4:
        elements = elements[:, :, 0::2] | (elements[:, :, 1::2] << 4)
    return elements.reshape(*elements.shape[:2], -1).contiguous()


def dot_scales(scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """int4 ``scales_and_zeros`` [in / 32, out, 2] as ``csrc/dot_linear.cpp``'s [out / 16, in / 32, 32]: each
    block's 16 scales, then its 16 zeros."""
    groups, out_features, _ = scales_and_zeros.shape
    blocks = scales_and_zeros.view(groups, out_features // 16, 16, 2).permute(1, 0, 3, 2)
    return blocks.reshape(out_features // 16, groups, 32).contiguous()


class Int8Linear(QuantizedLinear):
    """Weight ``q * scale``: ``q`` int8 [out, in], one scale per output channel (symmetric absmax)."""

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__((qweight.float() * scales.float()[:, None]).to(scales.dtype), bias)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @classmethod
    def quantize(cls, linear: nn.Linear, dtype: torch.dtype) -> Int8Linear:
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127
        qweight = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls(qweight, scales.to(dtype), bias)

    @staticmethod
    def matmul(x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        qweight, scales = tensors
        if qweight.dim() > 2:  # a blocked kernel's
            return _blocked_call(x, qweight, scales, 8)
        return torch.ops.aten._weight_int8pack_mm(x, qweight, scales)

    def kernel_tensors(self) -> tuple[torch.Tensor, ...] | None:
        if self.qweight.device.type != "cpu":
            return None
        return self._blocked_tensors(self.qweight, self.scales, 8) or (self.qweight, self.scales)

    @classmethod
    def joined(cls, layers: Sequence[QuantizedLinear]) -> tuple[torch.Tensor, ...] | None:
        qweight = torch.cat([layer.qweight for layer in layers])  # type: ignore[attr-defined]
        scales = torch.cat([layer.scales for layer in layers])  # type: ignore[attr-defined]
        kernel = blocked_kernel(qweight, 8)
        return (qweight, scales) if kernel is None else blocked_tensors(kernel, qweight, scales, 8)


class Int4Linear(QuantizedLinear):
    """Weight ``(q - 8) * scale + zero`` per group of 32 inputs, ``q`` in 0..15 (min-max, asymmetric).

    ``q`` is kept one per byte (to join layers); ``packed`` holds it two per byte in the layout of
    ``_weight_int4pack_mm_for_cpu`` (CPU only); ``scales_and_zeros`` is [in / 32, out, 2].
    """

    def __init__(self, q: torch.Tensor, scales_and_zeros: torch.Tensor, bias: torch.Tensor | None) -> None:
        out_features, in_features = q.shape
        scales, zeros = scales_and_zeros.float().unbind(-1)  # [groups, out]
        # (q - 8) * scale + zero rounded once to float32 (exact in float64, then rounded), as the AMX kernel's FMA
        groups = q.double().view(out_features, -1, INT4_GROUP) - 8
        weight = (groups * scales.double().T[..., None] + zeros.double().T[..., None]).view(out_features, in_features)
        super().__init__(weight.float().to(scales_and_zeros.dtype), bias)
        self.register_buffer("q", q)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("packed", _pack_int4(q))

    @classmethod
    def quantize(cls, linear: nn.Linear, dtype: torch.dtype) -> Int4Linear:
        """Exact for weights dequantized from Q4_1 (up to the scales' rounding to ``dtype``)."""
        weight = linear.weight.detach().float()
        out_features, in_features = weight.shape
        groups = weight.view(out_features, in_features // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15).view(out_features, in_features)
        zeros = low + 8 * scales  # the kernel dequantizes (q - 8) * scale + zero
        scales_and_zeros = torch.stack([scales.T, zeros.T], dim=-1).to(dtype).contiguous()
        bias = None if linear.bias is None else linear.bias.detach().to(dtype)
        return cls(q.to(torch.uint8), scales_and_zeros, bias)

    @staticmethod
    def matmul(x: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        packed, scales_and_zeros = tensors
        if packed.dim() > 2:  # a blocked kernel's
            return _blocked_call(x, packed, scales_and_zeros, 4)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, INT4_GROUP, scales_and_zeros)

    def kernel_tensors(self) -> tuple[torch.Tensor, ...] | None:
        if self.packed is None:
            return None
        return self._blocked_tensors(self.q, self.scales_and_zeros, 4) or (self.packed, self.scales_and_zeros)

    @classmethod
    def joined(cls, layers: Sequence[QuantizedLinear]) -> tuple[torch.Tensor, ...] | None:
        q = torch.cat([layer.q for layer in layers])  # type: ignore[attr-defined]
        scales_and_zeros = torch.cat([layer.scales_and_zeros for layer in layers], dim=1)  # type: ignore[attr-defined]
        if (kernel := blocked_kernel(q, 4)) is not None:
            return blocked_tensors(kernel, q, scales_and_zeros, 4)
        packed = _pack_int4(q)
        return None if packed is None else (packed, scales_and_zeros)


def _pack_int4(q: torch.Tensor) -> torch.Tensor | None:
    """``q`` [out, in] in the CPU kernel's layout, or None off the CPU or where the kernel cannot take it."""
    if q.device.type != "cpu" or q.shape[0] % 16:
        return None
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 2)


class FusedKernel:
    """Quantized layers reading the same input, as one kernel call for decode rows: one weight read and one
    launch instead of one per layer (q/k/v, gate/up). Holds no dense copy."""

    def __init__(
        self, kind: type[QuantizedLinear], tensors: tuple[torch.Tensor, ...], layers: Sequence[QuantizedLinear]
    ) -> None:
        self.kind, self.tensors = kind, tensors
        self.splits = [layer.out_features for layer in layers]
        self.bias: torch.Tensor | None = None
        if any(layer.bias is not None for layer in layers):
            zeros = [layer.weight.new_zeros(layer.out_features) for layer in layers]
            self.bias = torch.cat(
                [z if layer.bias is None else layer.bias for z, layer in zip(zeros, layers, strict=True)]
            )

    @classmethod
    def of(cls, layers: Sequence[nn.Module]) -> FusedKernel | None:
        """The fused kernel of ``layers``, or None unless they are all int8 or all int4 layers with a kernel."""
        kinds = {type(layer) for layer in layers}
        if len(kinds) != 1 or not issubclass(kind := kinds.pop(), QuantizedLinear):
            return None
        if any(layer.kernel_tensors() is None for layer in layers):  # type: ignore[attr-defined]
            return None
        tensors = kind.joined(layers)  # type: ignore[arg-type]
        return None if tensors is None else cls(kind, tensors, layers)  # type: ignore[arg-type]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's output for bfloat16 rows ``x`` [..., in] (at most ``KERNEL_ROWS`` rows)."""
        return list(_kernel_call(self.kind.matmul, self.tensors, self.bias, x).split(self.splits, dim=-1))
