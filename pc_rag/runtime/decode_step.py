"""One decode step of a Llama-style decoder, written out: fused projections and grouped-query attention.

A decode step is bandwidth-bound: every weight and the whole cache are read once for one token, so the step
computes ``STEP_ROWS`` rows for the price of one: the fed token and draft tokens to verify (speculative decoding),
or padding. Through transformers' modules the small int8/int4 kernels run one per projection (7 per layer) and the
attention of one query takes the generic path. Here q/k/v and gate/up each run as one fused kernel
(``FusedKernel``), each query attends to the cache with its heads grouped, and the new keys and values are
written into the preallocated buffer in place; transformers' own norm, rotary and projection modules are called
as they are, in the order and dtypes of its forward. Models it does not describe exactly
(sliding windows, partial rotary, other norms or activations) get ``None`` from ``DecodeStep.of`` and
decode through the model's forward. This module knows nothing about prompts or modules.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pc_rag.attention import FLASH_CPU
from pc_rag.kv import BufferCache
from pc_rag.runtime.cpu_kernels import DecodeAttention as DecodeAttentionKernel
from pc_rag.runtime.cpu_kernels import decode_attention_over
from pc_rag.runtime.native_layers import NativeLayers
from pc_rag.runtime.verify_attention import BucketedAttention, bucket_end
from pc_rag.weights import KERNEL_ROWS, FusedKernel, QuantizedLinear

_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3"}  # rotate-half RoPE on the whole head, RMSNorm, SiLU MLP
_BUILT: weakref.WeakKeyDictionary[nn.Module, dict[type, object]] = weakref.WeakKeyDictionary()
_LOCK = threading.RLock()

T = TypeVar("T")


def built_once(kind: Callable[[PreTrainedModel], T], model: PreTrainedModel, described_only: bool = True) -> T | None:
    """``kind(model)``, built once per model and kind (``DecodeStep``, the batched step, the packed prefill, the
    model runner); None when a step written out like ``DecodeStep`` would not equal the model's forward
    (``describes``), unless ``described_only`` is False (a kind that serves every model)."""
    with _LOCK:  # reentrant: a kind may build the kinds it uses
        built = _BUILT.setdefault(model, {})
        if kind not in built:
            built[kind] = kind(model) if describes(model) or not described_only else None
        return built[kind]  # type: ignore[return-value]


class FusedLayer:
    """One decoder layer's modules, with its projections fused where the weights allow.

    ``project`` and ``finish`` are the layer around its attention, for ``x`` [N, T, hidden] (N sequences of T
    tokens): every step written out here (one token, a batch of rows, a padded bucket of tokens) calls them and
    differs only in how it attends. ``fused``: use the fused kernels (quantized layers, at most
    ``weights.KERNEL_ROWS`` rows), with a merged adapter's low-rank term added to the rows of the layer it acts on
    (``kernel_corrections``); where a hook acts on one of the layers they join, those run as their modules, so it
    acts inside the step as in the model's forward."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = FusedKernel.of([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = FusedKernel.of([mlp.gate_proj, mlp.up_proj])

    def project(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], fused: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [N, H, T, D] and keys [N, H_kv, T, D] after RoPE, and values [N, H_kv, T, D], of ``x``."""
        layer = self.layer
        attn = layer.self_attn
        rows, count, head_dim = x.shape[0], x.shape[1], attn.head_dim
        h = rms_norm(layer.input_layernorm, x)
        q, k, v = _through(self.qkv if fused else None, (attn.q_proj, attn.k_proj, attn.v_proj), h)
        q, k = q.view(rows, count, -1, head_dim), k.view(rows, count, -1, head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalizes each head's query and key
            q, k = rms_norm(attn.q_norm, q), rms_norm(attn.k_norm, k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *rotary)
        return q, k, v.view(rows, count, -1, head_dim).transpose(1, 2)

    def finish(self, x: torch.Tensor, attended: torch.Tensor, fused: bool = True) -> torch.Tensor:
        """The layer's output: ``x`` plus the attention output ``attended`` [N, T, H * D] through ``o_proj``, then
        the MLP block."""
        layer = self.layer
        mlp = layer.mlp
        x = x + by_kernel_rows(layer.self_attn.o_proj, attended, fused)
        h = rms_norm(layer.post_attention_layernorm, x)
        gate, up = _through(self.gate_up if fused else None, (mlp.gate_proj, mlp.up_proj), h)
        return x + by_kernel_rows(mlp.down_proj, F.silu(gate) * up, fused)


def _through(kernel: FusedKernel | None, modules: Sequence[nn.Module], h: torch.Tensor) -> list[torch.Tensor]:
    """Each of ``modules``' output for ``h``: the fused kernel, called on ``KERNEL_ROWS`` rows at a time, with
    what acts on a module added to its rows (a merged adapter's low-rank term), or each module called where
    something acts that a kernel's rows cannot take (a hook)."""
    corrections = kernel_corrections(*modules) if kernel is not None else None
    if kernel is None or corrections is None:
        return [module(h) for module in modules]
    parts = [
        [out if fix is None else fix(out, rows) for out, fix in zip(kernel(rows), corrections, strict=True)]
        for rows in _row_groups(h)
    ]
    return [torch.cat(outs).view(*h.shape[:-1], -1) if len(parts) > 1 else outs[0] for outs in zip(*parts, strict=True)]


def _row_groups(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` [..., features] as itself when it has at most ``KERNEL_ROWS`` rows, else as [KERNEL_ROWS or fewer,
    features] groups: a quantized kernel's row gets the bits it gets alone only in calls of at most that many."""
    rows = x.numel() // x.shape[-1]
    if rows <= KERNEL_ROWS:
        return [x]
    return list(x.reshape(rows, x.shape[-1]).split(KERNEL_ROWS))


def by_kernel_rows(module: nn.Module, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``module(x)``; a quantized layer on its kernel (``fused``) takes the rows ``KERNEL_ROWS`` at a time."""
    groups = _row_groups(x) if fused else [x]  # one group (no tensor op) for a decode step's few rows
    if len(groups) == 1 or not (isinstance(module, QuantizedLinear) and module.takes_kernel(groups[0])):
        return module(x)
    return torch.cat([module(rows) for rows in groups]).view(*x.shape[:-1], -1)


STEP_ROWS = KERNEL_ROWS
"""Rows every decode step computes: the fed token and up to ``STEP_ROWS - 1`` draft tokens, padded. A GEMM row's
bits depend on the GEMM's shape (on the CPU 1 row and 4 rows take different kernels), never on the other rows'
values, so a step of one token and a verify of drafts give each row the same bits: speculation is exact."""


class DecodeStep:
    """``step(tokens, position, cache)``: the logits [T, V] after each of ``tokens`` (T <= ``STEP_ROWS``), the
    first at ``position``; they are written after the cache's tokens (the cache advances by T).

    One token and a token followed by drafts (speculative decoding) run the same shapes: the rows are padded to
    ``STEP_ROWS``, and row ``t`` attends to the cache and rows ``< t`` with bits that depend on its slot only: in
    the CPU kernel (``cpu_kernels``, over a bfloat16 cache) for every step, else, in a speculative request
    (``bucketed``), as a batch entry whose shape depends on its slot only (``verify_attention``), so a row's
    logits are bit-identical whether it was fed or drafted. Without the kernel, dense plain decoding attends its
    one row in one exact call (``cache_attention``).
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self._decoder = model.get_decoder()
        self._layers = [FusedLayer(layer) for layer in self._decoder.layers]
        self._native: list[NativeLayers | None] = []  # built on the first step over the attention kernel

    @classmethod
    def of(cls, model: PreTrainedModel) -> DecodeStep | None:
        """The model's step, built once per model; None when this step would not equal the model's forward."""
        return built_once(cls, model)

    @staticmethod
    def serves(cache: Cache) -> bool:
        """Whether the step can write into ``cache``: one preallocated buffer, as ``KVBuffer.cache`` makes."""
        return isinstance(cache, BufferCache) and cache.buffer.keys.shape[1] == 1

    def __call__(
        self, tokens: Sequence[int], position: int, cache: BufferCache, rows: int = STEP_ROWS, bucketed: bool = False
    ) -> torch.Tensor:
        """``rows``: the row count every matmul runs (the tokens, then padding): 1 for plain decoding, where a
        one-row GEMM is the fastest; ``STEP_ROWS`` for every step of a speculative request, so a verify row
        equals the step without drafts bit for bit. The rows attend through the CPU kernel where it runs, over a
        bfloat16 cache (``cpu_kernels``: one call, each row's bits its own). Without it, ``bucketed``: the rows
        attend in one call, each as a batch entry whose shape depends on its slot only (``BucketedAttention``:
        every step of a speculative request, and plain steps that must equal it), instead of one exact call per
        row."""
        count = len(tokens)
        assert 0 < count <= rows <= STEP_ROWS, f"a step takes 1 to {rows} tokens, got {count}"
        length = cache.get_seq_length()
        kernel = decode_attention_over(cache.buffer.keys)
        bucketed = bucketed and kernel is None  # the kernel gives each row its own bits without buckets
        room = bucket_end(length + count - 1) - length if bucketed else count
        buffer = cache.gathered(room=room)
        device = buffer.keys.device
        padded = [*tokens, *[tokens[0]] * (rows - count)]  # padding rows repeat row 0, never written back
        positions = [*range(position, position + count), *[position] * (rows - count)]
        attention: BucketedAttention | RowsAttention
        if kernel is not None:
            attention = RowsAttention(kernel, torch.arange(length + 1, length + count + 1))
        elif bucketed:
            attention = BucketedAttention(length, count, buffer.keys.dtype, device)
            for tensor in (buffer.keys, buffer.values):  # finite past the step's tokens: masked, read as 0 * value
                tensor[..., length + count : attention.end, :] = 0
        else:
            attention = RowsAttention(None, torch.arange(length + 1, length + count + 1))
        logits = self._logits(
            torch.tensor(padded, device=device)[:, None], torch.tensor(positions, device=device)[:, None],
            buffer.keys, buffer.values, length, count, attention,
        )  # fmt: skip
        for layer in cache.layers:
            layer.advance(count)
        return logits

    def _logits(
        self, tokens: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int,
        count: int, attention: BucketedAttention | RowsAttention,
    ) -> torch.Tensor:  # fmt: skip
        """Logits [count, V] after the first ``count`` of ``tokens`` [rows, 1]; writes their keys and values
        into ``keys``/``values`` [L, 1, H_kv, capacity, D] at slots ``length + t``."""
        decoder = self._decoder
        x = decoder.embed_tokens(tokens)  # [rows, 1, hidden]
        rotary = decoder.rotary_emb(x, positions)
        native = self._native_layers() if isinstance(attention, RowsAttention) and attention.on_kernel else None
        out = None if native is None else native.run(x, rotary, keys, values, length, count, attention.ends)
        if out is not None:  # the loop below, in C++ (native_layers)
            return self._model.lm_head(rms_norm(decoder.norm, out))[:count, -1]
        for index, layer in enumerate(self._layers):
            q, k, v = layer.project(x, rotary)  # [rows, H(_kv), 1, D]
            layer_keys, layer_values = keys[index], values[index]  # [1, H_kv, capacity, D]
            layer_keys[0, :, length : length + count] = k[:count, :, 0].transpose(0, 1)
            layer_values[0, :, length : length + count] = v[:count, :, 0].transpose(0, 1)
            attended = attention(q[:count], layer_keys, layer_values, layer.layer.self_attn.scaling)  # [count, 1, H*D]
            if x.shape[0] > count:
                attended = torch.cat([attended, attended[:1].expand(x.shape[0] - count, -1, -1)])
            x = layer.finish(x, attended)
        return self._model.lm_head(rms_norm(decoder.norm, x))[:count, -1]

    def _native_layers(self) -> NativeLayers | None:
        if not self._native:
            with _LOCK:
                if not self._native:
                    self._native.append(NativeLayers.of(self._layers))
        return self._native[0]


class RowsAttention:
    """Row ``t`` of a step attends to the cache through its own slot, ``ends[t]`` keys: in one call of the CPU
    kernel (``cpu_kernels``; a row's bits depend on its own query and keys only) or, without it, one exact flash
    call per row (``cache_attention``)."""

    def __init__(self, kernel: DecodeAttentionKernel | None, ends: torch.Tensor) -> None:
        self._kernel, self.ends = kernel, ends

    @property
    def on_kernel(self) -> bool:
        return self._kernel is not None

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """``q`` [count, H, 1, D], ``keys``/``values`` [1, H_kv, capacity, D]; returns [count, 1, H * D]."""
        count, kv_heads, head_dim = q.shape[0], keys.shape[1], q.shape[-1]
        if self._kernel is None:
            ends = self.ends.tolist()
            rows = [cache_attention(q[t : t + 1], keys[:, :, :e], values[:, :, :e], scale) for t, e in enumerate(ends)]
            return torch.cat(rows)
        folded = q.reshape(count, kv_heads, -1, head_dim).float().contiguous()  # a copy unless q was float32
        out = self._kernel(folded, keys[0], values[0], self.ends, scale)
        return out.to(q.dtype).reshape(count, 1, -1)


def cache_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Grouped-query attention of one new token over the cache that already holds its key and value: ``q``
    [1, H, 1, D], ``keys``/``values`` [1, H_kv, S, D] (a view of the buffer, read in place); returns [1, 1, H * D].

    The query heads are folded onto their KV head (query head h = g * n_rep + r reads KV head g), so the cache is
    never repeated. On the CPU this is one flash pass (no mask: the token sees every slot given)."""
    folded = q.reshape(1, keys.shape[1], -1, q.shape[-1])  # [1, H_kv, n_rep, D]
    if FLASH_CPU is not None and q.device.type == "cpu":
        out = FLASH_CPU(folded, keys, values, scale=scale)[0]
    else:
        out = F.scaled_dot_product_attention(folded, keys, values, scale=scale)
    return out.reshape(1, 1, -1)


Correction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def untouched(module: nn.Module) -> bool:
    """Whether only its class's forward acts on ``module``: no hook, no forward set on the instance."""
    return not (module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def kernel_corrections(*modules: nn.Module) -> list[Correction | None] | None:
    """What acts on each of ``modules`` now beyond its class's forward, as a correction ``fix(out, x)`` of the
    rows a fused kernel computed for it (None where nothing acts); None where something acts that a kernel's
    rows cannot take: a forward hook, or a forward set on the instance without a ``kernel_correction()`` for this
    call. A forward that says it does not act now (``acts()`` False: a merged adapter outside its ``applied()``)
    counts as nothing; a merged splice adapter on a quantized layer gives its low-rank term
    (``SpliceAdapter.attach(merged=True)``), row for row as the module would add it."""
    found: list[Correction | None] = []
    for module in modules:
        if untouched(module):
            found.append(None)
            continue
        if module._forward_hooks or module._forward_pre_hooks:
            return None
        forward = module.__dict__.get("forward")
        if forward is None or not getattr(forward, "acts", lambda: True)():
            found.append(None)
            continue
        correction = getattr(forward, "kernel_correction", lambda: None)()
        if correction is None:
            return None
        found.append(correction)
    return found


def rows_exact(model: PreTrainedModel) -> bool:
    """Whether, under the calling thread's context, whatever acts on the decoder's linear layers gives a row the
    same bits in a step of any row count: nothing, or merged adapters' padded low-rank terms (not a hook's)."""
    linears = [m for m in model.get_decoder().layers.modules() if isinstance(m, nn.Linear | QuantizedLinear)]
    return kernel_corrections(*linears) is not None


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm (float32 statistics, weight applied in the input dtype) as one fused op."""
    normalized = F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon)
    return norm.weight * normalized.to(x.dtype)


def describes(model: PreTrainedModel) -> bool:
    """Whether a step written out as here equals the model's forward (Llama-style decoders, see ``DecodeStep``)."""
    config = model.config.get_text_config()
    if config.model_type not in _ARCHITECTURES or getattr(config, "hidden_act", None) != "silu":
        return False
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        return False
    decoder = model.get_decoder()
    norms = [
        decoder.norm,
        *(n for layer in decoder.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)),
    ]
    return all(hasattr(layer, "self_attn") and hasattr(layer.mlp, "gate_proj") for layer in decoder.layers) and all(
        type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") for n in norms
    )
