"""The batched decode step with no host value in it: what a CUDA graph per batch-size bucket captures.

``BatchDecodeStep`` reads host values every step (the longest private row, the shared runs and their readers), so
each step launches hundreds of kernels and syncs. ``StaticBatchStep`` takes every per-step value as a device
tensor of a fixed shape: the tokens, positions and private lengths of ``B`` rows (a batch-size bucket), and a
visibility mask of each row over the whole shared pool. The shapes then depend only on ``B`` and the buffers, so
the step can be captured once per bucket and replayed, or compiled with ``fullgraph=True`` (tested on the CPU).

Attention is flash-decoding style: the shared pool is split along its keys into ``chunk`` slots, every chunk is
attended by every row's queries at once (one batched matmul, the grid a GPU needs at decode), the private row is
one more part, and the parts merge by log-sum-exp (``partition_attention._merge``). Rows past the live ones pad the
bucket: give them a free arena row and length 0 (they write its slot 0, which no live row reads).

Not yet wired into the scheduler: its serving loop still runs ``BatchDecodeStep``. This module knows nothing about
requests, segments or scheduling: it is handed tensors.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from pc_rag.runtime.decode_step import FusedLayer, built_once, rms_norm
from pc_rag.runtime.partition_attention import _merge

SHARED_CHUNK = 256
"""Shared-pool slots per split-KV part (the pool's capacity is a multiple of it, or one part holds it all)."""


class StaticBatchStep:
    """``step(tokens, positions, lengths, rows, shared_keys, shared_values, shared_visible, keys, values)``.

    Shapes: ``tokens``, ``positions``, ``lengths``, ``rows`` [B] long (row b is arena row ``rows[b]`` holding
    ``lengths[b]`` private entries before this step); ``shared_keys``/``shared_values`` [L, H_kv, S, D] (the whole
    pool); ``shared_visible`` [B, S] bool (the pool slots row b reads); ``keys``/``values`` [L, R, H_kv, C, D] (the
    arena). Writes each row's new key and value at slot ``lengths[b]`` of its arena row and returns logits [B, V].
    The caller advances the lengths. Every row must see at least one key (its own new one always)."""

    def __init__(self, model: PreTrainedModel, chunk: int = SHARED_CHUNK) -> None:
        self._model = model
        self._decoder = model.get_decoder()
        self._layers = [FusedLayer(layer) for layer in self._decoder.layers]
        self.chunk = chunk

    @classmethod
    def of(cls, model: PreTrainedModel) -> StaticBatchStep | None:
        """The model's step, built once per model; None when it would not equal the model's forward."""
        return built_once(cls, model)

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
        shared_keys: torch.Tensor, shared_values: torch.Tensor, shared_visible: torch.Tensor,
        keys: torch.Tensor, values: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        decoder = self._decoder
        x = decoder.embed_tokens(tokens[:, None])  # [B, 1, hidden]
        rotary = decoder.rotary_emb(x, positions[:, None])
        capacity = keys.shape[-2]
        private = torch.arange(capacity, device=tokens.device)[None, :] <= lengths[:, None]  # [B, C]
        for index, fused in enumerate(self._layers):
            layer_keys, layer_values = keys[index], values[index]  # [R, H_kv, C, D]
            q, k, v = fused.project(x, rotary, False)  # [B, H, 1, D], [B, H_kv, 1, D]
            layer_keys[rows, :, lengths] = k[:, :, 0]
            layer_values[rows, :, lengths] = v[:, :, 0]
            scale = fused.layer.self_attn.scaling
            out = split_kv_attention(q[:, :, 0], shared_keys[index], shared_values[index], shared_visible,
                                     layer_keys[rows], layer_values[rows], private, scale, self.chunk)  # fmt: skip
            x = fused.finish(x, out.reshape(x.shape[0], 1, -1).to(x.dtype), False)
        return self._model.lm_head(rms_norm(decoder.norm, x))[:, -1]


def split_kv_attention(
    query: torch.Tensor, shared_keys: torch.Tensor, shared_values: torch.Tensor, shared_visible: torch.Tensor,
    own_keys: torch.Tensor, own_values: torch.Tensor, private: torch.Tensor, scale: float, chunk: int = SHARED_CHUNK,
) -> torch.Tensor:  # fmt: skip
    """``query`` [B, H, D] over the shared pool ``shared_keys``/``shared_values`` [H_kv, S, D] (the slots each row
    sees: ``shared_visible`` [B, S] bool), split in parts of ``chunk`` slots, and over each row's own
    [B, H_kv, C, D] (``private`` [B, C] bool); the parts merged by log-sum-exp, [B, H, D] in float32. No shape
    depends on a length: capturable as it is."""
    batch, heads, dim = query.shape
    kv_heads, slots = shared_keys.shape[0], shared_keys.shape[1]
    grouped = query.view(batch, kv_heads, heads // kv_heads, dim).float()  # [B, H_kv, n_rep, D]
    chunk = chunk if slots % chunk == 0 else slots
    parts = slots // chunk
    k = shared_keys.float().view(kv_heads, parts, chunk, dim)
    v = shared_values.float().view(kv_heads, parts, chunk, dim)
    # every row's queries against every chunk in one matmul: [P, B, H_kv, n_rep, chunk]
    scores = torch.einsum("bgrd,gpsd->pbgrs", grouped, k) * scale
    visible = shared_visible.view(batch, parts, chunk).transpose(0, 1)[:, :, None, None, :]
    shared_out, shared_lse = _softmax_parts(scores, visible, v.permute(1, 0, 2, 3)[:, None])
    own = torch.einsum("bgrd,bgsd->bgrs", grouped, own_keys.float()) * scale  # [B, H_kv, n_rep, C]
    own_out, own_lse = _softmax_parts(own[None], private[None, :, None, None, :], own_values.float()[None])
    merged = _merge(torch.cat([own_out, shared_out]), torch.cat([own_lse, shared_lse]))
    return merged.reshape(batch, heads, dim)


def _softmax_parts(
    scores: torch.Tensor, visible: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per part: output [P, B, H_kv, n_rep, D] and log-sum-exp [P, B, H_kv, n_rep] of ``scores`` [P, B, H_kv,
    n_rep, S] over the ``visible`` keys; a part a row sees nothing of gives output 0 and log-sum-exp -inf (weight
    exactly 0 in the merge), never NaN."""
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).min)
    weights = torch.exp(scores - top)
    total = weights.sum(-1)
    out = torch.matmul(weights, values) / total.clamp_min(torch.finfo(scores.dtype).tiny)[..., None]
    return out, top[..., 0] + torch.log(total)
