"""A decode step's decoder layers as one C++ call, for quantized models over the CPU attention kernel.

``DecodeStep`` writes a layer out as ~100 ATen calls; on SmolLM2 in int4 a one-row step at 1K ran ~3,000 of them
from Python at ~7 us each, around ~8 ms of matmul and attention kernels. ``csrc/decode_layers.cpp`` runs the loop
in C++ with the GIL released, with the same bits: the same kernel calls on the same shapes, and the elementwise ops
between them as loops that round where ATen rounds. It serves the layers
``DecodeStep`` writes out where every projection runs on a quantized CPU kernel (int8 or int4: the fused q/k/v and
gate/up kernels, o_proj and down_proj) and the cache is bfloat16 (the attention kernel's); what acts on a layer
must be nothing or a merged adapter's low-rank term (``LowRankTerm``). Elsewhere, or with ``PC_RAG_CPU_KERNELS=0``,
``NativeLayers.of`` is None or ``run`` returns None, and the step runs its Python loop
(``PC_RAG_NATIVE_LAYERS=0`` turns this loop alone off).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from pc_rag.runtime.cpu_kernels import decode_layers
from pc_rag.runtime.low_rank import LowRankTerm
from pc_rag.weights import FusedKernel, Int4Linear, Int8Linear

if TYPE_CHECKING:
    from pc_rag.runtime.decode_step import FusedLayer

_KINDS: dict[type, int] = {Int4Linear: 4, Int8Linear: 8}
SWITCH = "PC_RAG_NATIVE_LAYERS"
"""``PC_RAG_NATIVE_LAYERS=0``: steps run their Python loop (to compare the two; the attention kernel stays on)."""


class NativeLayers:
    """``run(...)``: the hidden states after every decoder layer, the step's keys and values written into the
    buffer, as ``DecodeStep._logits``'s loop over the attention kernel computes them, bit for bit."""

    def __init__(self, native: object, modules: list[tuple[nn.Module, ...]]) -> None:
        self._native = native
        self._modules = modules  # per layer: q, k, v, o, gate, up, down, whose corrections each step reads
        self._flat = [module for layer in modules for module in layer]

    @classmethod
    def of(cls, layers: Sequence[FusedLayer]) -> NativeLayers | None:
        """The native layers of a step's ``layers``, or None where a layer does not run on quantized kernels or
        the CPU kernels are not built."""
        if not layers or os.environ.get(SWITCH, "1") == "0" or (kind := decode_layers()) is None:
            return None
        eps, kinds = _epsilons(layers[0]), _kinds(layers[0])
        if 0 in kinds or any(_epsilons(f) != eps or _kinds(f) != kinds for f in layers):
            return None  # a projection off the quantized kernels, or layers that differ: the loop takes one of each
        tensors = [_layer_tensors(fused) for fused in layers]
        if any(parts is None for parts in tensors):
            return None
        modules = [
            (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            for a, m in ((fused.layer.self_attn, fused.layer.mlp) for fused in layers)
        ]
        attn = layers[0].layer.self_attn
        config = attn.config
        splits = [layers[0].qkv.splits, layers[0].gate_up.splits]  # type: ignore[union-attr]
        native = kind(
            tensors, splits, kinds, eps, config.num_attention_heads, config.num_key_value_heads, attn.head_dim,
            float(attn.scaling),
        )  # fmt: skip
        return cls(native, modules)

    def run(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor,
        length: int, count: int, ends: torch.Tensor,
    ) -> torch.Tensor | None:  # fmt: skip
        """``x`` [rows, 1, hidden] through every layer (rows ``< count`` written at slots ``length + t`` of
        ``keys``/``values`` [L, 1, H_kv, capacity, D] and attending to ``ends[t]`` slots); None where something
        acts on a layer now that the C++ loop does not compute (a hook, an adapter's plain rows): the caller then
        runs its Python loop."""
        corrections = self._corrections()
        if corrections is None:
            return None
        cos, sin = rotary
        return self._native.forward(x, cos, sin, keys, values, length, count, ends, corrections)  # type: ignore[attr-defined]

    def _corrections(self) -> list[torch.Tensor | None] | None:
        """Every layer's (a, b) per module, flat, or [] where nothing acts; None where something else acts."""
        from pc_rag.runtime.decode_step import kernel_corrections, untouched  # decode_step imports this module

        if all(untouched(m) for m in self._flat):
            return []  # kernel_corrections' answer where nothing acts, without its lists (each step asks)
        flat: list[torch.Tensor | None] = []
        acting = False
        for modules in self._modules:
            fixes = kernel_corrections(*modules)
            if fixes is None:
                return None
            for fix in fixes:
                if fix is None:
                    flat += [None, None]
                elif isinstance(fix, LowRankTerm):
                    flat += [fix.a, fix.b]
                    acting = True
                else:
                    return None
        return flat if acting else []


def _kind(module: FusedKernel | nn.Module | None) -> int:
    """4 or 8 for an int4 or int8 kernel (fused or one layer), 0 for anything else (a dense layer, no fused kernel)."""
    kind = module.kind if isinstance(module, FusedKernel) else type(module)
    return _KINDS.get(kind, 0)


def _layer_tensors(fused: FusedLayer) -> list[torch.Tensor | None] | None:
    """One layer's tensors in ``csrc/decode_layers.cpp``'s slot order (its projections on quantized kernels, see
    ``_kinds``), or None where o_proj or down_proj has no kernel here or the layer does not compute in bfloat16."""
    layer = fused.layer
    attn, mlp = layer.self_attn, layer.mlp
    o, down = attn.o_proj.kernel_tensors(), mlp.down_proj.kernel_tensors()
    if o is None or down is None or not _is_bfloat16(layer):
        return None
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return [
        layer.input_layernorm.weight, *fused.qkv.tensors, fused.qkv.bias,  # type: ignore[union-attr]
        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
        *o, attn.o_proj.bias, layer.post_attention_layernorm.weight,
        *fused.gate_up.tensors, fused.gate_up.bias,  # type: ignore[union-attr]
        *down, mlp.down_proj.bias,
    ]  # fmt: skip


def _is_bfloat16(layer: nn.Module) -> bool:
    """Quantized layers compute in bfloat16: the norms' weights say so."""
    return layer.input_layernorm.weight.dtype == torch.bfloat16 and layer.input_layernorm.weight.device.type == "cpu"


def _epsilons(fused: FusedLayer) -> list[float]:
    """The layer's norms' epsilons: input, post-attention, and the per-head query and key norms (0 without)."""
    layer = fused.layer
    attn = layer.self_attn
    norms = (layer.input_layernorm, layer.post_attention_layernorm, getattr(attn, "q_norm", None),
             getattr(attn, "k_norm", None))  # fmt: skip
    return [0.0 if norm is None else float(norm.variance_epsilon) for norm in norms]


def _kinds(fused: FusedLayer) -> list[int]:
    """The layer's kernel kinds (4, 8, or 0 for none) of q/k/v, o, gate/up and down."""
    layer = fused.layer
    return [_kind(k) for k in (fused.qkv, layer.self_attn.o_proj, fused.gate_up, layer.mlp.down_proj)]
