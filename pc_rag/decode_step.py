"""One decode step of a Llama-style decoder, written out: fused projections and grouped-query attention.

A decode step is bandwidth-bound: every weight and the whole cache are read once for one token.
Through transformers' modules the small int8/int4 kernels run one per projection (7 per layer) and the
attention of one query takes the generic path. Here q/k/v and gate/up each run as one fused kernel
(``FusedKernel``), the query attends to the cache with its heads grouped, and the new keys and values
of all layers are written into the preallocated buffer in one copy; transformers' own norm, rotary and
projection modules are called as they are, in the order and dtypes of its forward. Models it does not describe exactly
(sliding windows, partial rotary, other norms or activations) get ``None`` from ``DecodeStep.of`` and
decode through the model's forward. This module knows nothing about prompts or modules.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pc_rag.attention import FLASH_CPU
from pc_rag.kv import BufferCache
from pc_rag.weights import FusedKernel

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
    ``weights.KERNEL_ROWS`` rows)."""

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
        if fused and self.qkv is not None:
            q, k, v = self.qkv(h)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
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
        x = x + layer.self_attn.o_proj(attended)
        h = rms_norm(layer.post_attention_layernorm, x)
        if fused and self.gate_up is not None:
            gate, up = self.gate_up(h)
        else:
            gate, up = mlp.gate_proj(h), mlp.up_proj(h)
        return x + mlp.down_proj(F.silu(gate) * up)

    def __call__(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's output for ``x`` [1, 1, hidden] after the cached ``keys``/``values`` [1, H_kv, S, D], and
        the new token's key and value [1, H_kv, 1, D] (the caller writes them into the cache)."""
        q, k, v = self.project(x, rotary)
        attended = decode_attention(q, k, v, keys, values, self.layer.self_attn.scaling)
        return self.finish(x, attended), k, v


class DecodeStep:
    """``step(token, position, cache)``: the next token's logits [V] after ``token`` at ``position``.

    ``compiled`` runs the step through ``torch.compile`` with a symbolic cache length: one graph for every
    context length, in which the norms, rotary, activations and residuals fuse into a few loops. Experimental:
    equal to the eager step on tiny models, but on the bundled SmolLM2 tracing did not finish in 15 minutes.
    """

    def __init__(self, model: PreTrainedModel, compiled: bool = False) -> None:
        self._model = model
        self._decoder = model.get_decoder()
        self._layers = [FusedLayer(layer) for layer in self._decoder.layers]
        self._run = torch.compile(self._logits, dynamic=True) if compiled else self._logits

    @classmethod
    def of(cls, model: PreTrainedModel) -> DecodeStep | None:
        """The model's step, built once per model; None when this step would not equal the model's forward."""
        return built_once(cls, model)

    @staticmethod
    def serves(cache: Cache) -> bool:
        """Whether the step can write into ``cache``: one preallocated buffer, as ``KVBuffer.cache`` makes."""
        return isinstance(cache, BufferCache) and cache.buffer.keys.shape[1] == 1

    def __call__(self, token: int, position: int, cache: BufferCache) -> torch.Tensor:
        length = cache.get_seq_length()
        # a spare slot: the cached keys stay a strict prefix of the buffer, so a compiled graph never
        # specializes on a full one (a recompile costs as much as the first compile)
        buffer = cache.gathered(room=2)
        device = buffer.keys.device
        logits, keys, values = self._run(
            torch.tensor([[token]], device=device), torch.tensor([[position]], device=device),
            buffer.keys, buffer.values, length,
        )  # fmt: skip
        buffer.keys[:, :, :, length : length + 1] = keys
        buffer.values[:, :, :, length : length + 1] = values
        for layer in cache.layers:
            layer.advance(1)
        return logits

    def _logits(
        self, token: torch.Tensor, position: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits [V] after ``token``, and its keys and values [L, 1, H_kv, 1, D]; reads the first ``length``
        tokens of the buffers ``keys``/``values`` [L, 1, H_kv, capacity, D] and writes nothing (a compiled graph
        that mutated them would copy them whole)."""
        decoder = self._decoder
        x = decoder.embed_tokens(token)
        rotary = decoder.rotary_emb(x, position)
        new_keys, new_values = [], []
        for index, layer in enumerate(self._layers):
            x, k, v = layer(x, rotary, keys[index, :, :, :length], values[index, :, :, :length])
            new_keys.append(k)
            new_values.append(v)
        logits = self._model.lm_head(rms_norm(decoder.norm, x))[0, -1]
        return logits, torch.stack(new_keys), torch.stack(new_values)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Grouped-query attention of the new token over the cache and itself: ``q`` [1, H, 1, D], ``k``/``v``
    [1, H_kv, 1, D], cached ``keys``/``values`` [1, H_kv, S, D]; returns [1, 1, H * D].

    On the CPU one flash pass over the cache (heads folded: query head h = g * n_rep + r reads KV head g)
    returns its log-sum-exp, and the new key's own score is merged in: the cache is read once and never
    copied. Elsewhere SDPA over the cache and the new key."""
    folded = q.reshape(1, keys.shape[1], -1, q.shape[-1])  # [1, H_kv, n_rep, D]
    if FLASH_CPU is not None and q.device.type == "cpu" and keys.shape[2] > 0:
        out, lse = FLASH_CPU(folded, keys, values, scale=scale)
        own = (folded.float() * k.float()).sum(-1) * scale  # [1, H_kv, n_rep]
        share = torch.sigmoid(lse - own).unsqueeze(-1)  # the cache's part of the softmax mass
        out = torch.lerp(v.float().expand_as(out), out.float(), share).to(q.dtype)  # rounded once, as SDPA does
    else:
        out = F.scaled_dot_product_attention(
            folded, torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2), scale=scale
        )
    return out.reshape(1, 1, -1)


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
