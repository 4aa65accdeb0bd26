"""Attention for cached serving: grouped-query SDPA without copying the cache per head.

When a few new tokens attend to a long spliced cache, transformers' SDPA path
repeats every key/value head ``n_rep`` times (a full copy of the cache per layer).
Here the query heads that share a KV head are folded into the query length
instead (``[B, H, Q, D] -> [B, H_kv, n_rep*Q, D]``), so SDPA reads the cache as
is. When the mask says "every cached key, then causal among the new tokens"
(the usual case), a CPU run attends to the cache without any mask and to the
new tokens causally, and merges the two by their log-sum-exp, which skips
applying a [Q, S] mask in every layer. A full prefill (queries as long as keys)
takes transformers' own path. This module knows nothing about PML or caches
beyond the tensors it is handed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTENTION = "pc_rag_sdpa"


def packed_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,  # [B, H_kv, S, D]
    attention_mask: torch.Tensor | None,  # [B, 1, Q, S], bool (True = attend) or additive float
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """SDPA that folds query-head groups into the query axis; falls back to transformers' SDPA otherwise."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    n_rep = heads // kv_heads
    if n_rep == 1 or q_len == key.shape[2] or attention_mask is None or kwargs.get("softcap") or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    q = query.reshape(batch, kv_heads, n_rep * q_len, dim)  # head h = g * n_rep + r shares KV head g
    out = _cache_then_causal(q, key, value, attention_mask, scaling)
    if out is None:
        mask = attention_mask[:, :, None].expand(-1, -1, n_rep, -1, -1).reshape(batch, 1, n_rep * q_len, -1)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _cache_then_causal(
    q: torch.Tensor,  # [B, H_kv, n_rep*Q, D]
    key: torch.Tensor,  # [B, H_kv, S, D]
    value: torch.Tensor,
    mask: torch.Tensor,  # [B, 1, Q, S]
    scaling: float | None,
) -> torch.Tensor | None:
    """Attention as two parts merged by log-sum-exp, or None when the mask is not cache-then-causal."""
    q_len, total = mask.shape[-2], mask.shape[-1]
    cached = total - q_len
    if _FLASH_CPU is None or q.device.type != "cpu" or mask.dtype != torch.bool or cached <= 0:
        return None
    causal = torch.ones(q_len, q_len, dtype=torch.bool, device=mask.device).tril()
    if not (bool(mask[..., :cached].all()) and torch.equal(mask[..., cached:], causal.expand_as(mask[..., cached:]))):
        return None
    out_cache, lse_cache = _FLASH_CPU(q, key[:, :, :cached], value[:, :, :cached], scale=scaling)
    # the new tokens' part is causal: unpack the heads ([B, H, Q, D], only the Q new keys repeated per head)
    # so the kernel's is_causal path applies, with no [n_rep*Q, Q] mask materialized
    batch, kv_heads, packed, dim = q.shape
    n_rep = packed // q_len
    heads_q = q.reshape(batch, kv_heads * n_rep, q_len, dim)
    new_k = key[:, :, cached:].repeat_interleave(n_rep, dim=1)
    new_v = value[:, :, cached:].repeat_interleave(n_rep, dim=1)
    out_new, lse_new = _FLASH_CPU(heads_q, new_k, new_v, is_causal=True, scale=scaling)
    out_new = out_new.reshape(batch, kv_heads, packed, dim)
    lse_new = lse_new.reshape(batch, kv_heads, packed)
    top = torch.maximum(lse_cache, lse_new)
    w_cache, w_new = (lse_cache - top).exp().unsqueeze(-1), (lse_new - top).exp().unsqueeze(-1)
    return (out_cache * w_cache + out_new * w_new) / (w_cache + w_new)


AttentionInterface.register(ATTENTION, packed_gqa_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)
