"""One decode step of a Llama-style decoder, written out: fused projections and grouped-query attention.

A decode step is bandwidth-bound: every weight and the whole cache are read once for one token.
Through transformers' modules the small int8/int4 kernels run one per projection (7 per layer) and the
attention of one query takes the generic path. Here q/k/v and gate/up each run as one fused kernel
(``FusedKernel``), the new key and value are written into the cache layer and the query attends with
grouped heads (SDPA's ``enable_gqa``), in the order and dtypes of transformers' own forward (its norm,
rotary and projection modules are called as they are). Models it does not describe exactly
(sliding windows, partial rotary, other norms or activations) get ``None`` from ``DecodeStep.of`` and
decode through the model's forward. This module knows nothing about prompts or modules.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pc_rag.weights import FusedKernel

_ARCHITECTURES = {"llama", "mistral", "qwen2", "qwen3"}  # rotate-half RoPE on the whole head, RMSNorm, SiLU MLP
_STEPS: weakref.WeakKeyDictionary[nn.Module, DecodeStep | None] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class _Layer:
    """One decoder layer's modules, with its projections fused where the weights allow."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = FusedKernel.of([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = FusedKernel.of([mlp.gate_proj, mlp.up_proj])

    def __call__(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: Cache, index: int
    ) -> torch.Tensor:
        layer = self.layer
        attn, mlp = layer.self_attn, layer.mlp
        h = _rms_norm(layer.input_layernorm, x)
        if self.qkv is not None:
            q, k, v = self.qkv(h)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q, k = q.view(1, 1, -1, attn.head_dim), k.view(1, 1, -1, attn.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalizes each head's query and key
            q, k = _rms_norm(attn.q_norm, q), _rms_norm(attn.k_norm, k)
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), *rotary)
        keys, values = cache.update(k, v.view(1, 1, -1, attn.head_dim).transpose(1, 2), index)
        out = F.scaled_dot_product_attention(q, keys, values, scale=attn.scaling, enable_gqa=True)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(1, 1, -1))
        h = _rms_norm(layer.post_attention_layernorm, x)
        if self.gate_up is not None:
            gate, up = self.gate_up(h)
        else:
            gate, up = mlp.gate_proj(h), mlp.up_proj(h)
        return x + mlp.down_proj(F.silu(gate) * up)


class DecodeStep:
    """``step(token, position, cache)``: the next token's logits [V] after ``token`` at ``position``."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self._decoder = model.get_decoder()
        self._layers = [_Layer(layer) for layer in self._decoder.layers]

    @classmethod
    def of(cls, model: PreTrainedModel) -> DecodeStep | None:
        """The model's step, built once per model; None when this step would not equal the model's forward."""
        with _LOCK:
            if model not in _STEPS:
                _STEPS[model] = cls(model) if _describes(model) else None
            return _STEPS[model]

    def __call__(self, token: int, position: int, cache: Cache) -> torch.Tensor:
        decoder = self._decoder
        device = decoder.embed_tokens.weight.device
        x = decoder.embed_tokens(torch.tensor([[token]], device=device))
        rotary = decoder.rotary_emb(x, torch.tensor([[position]], device=device))
        for index, layer in enumerate(self._layers):
            x = layer(x, rotary, cache, index)
        return self._model.lm_head(_rms_norm(decoder.norm, x))[0, -1]


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm (float32 statistics, weight applied in the input dtype) as one fused op."""
    normalized = F.rms_norm(x.float(), x.shape[-1:], eps=norm.variance_epsilon)
    return norm.weight * normalized.to(x.dtype)


def _describes(model: PreTrainedModel) -> bool:
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
