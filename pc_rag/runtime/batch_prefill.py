"""Prefill several requests in one pass: every weight is read once for all their new tokens, packed together.

Each request has already spliced its parts into its own buffer. Per layer, the new tokens of all requests run
through the norms and projections as one ``[N, hidden]`` block (no padding between requests); attention is per
request, over its own buffer (cached entries, then its new tokens causally), as a prefill alone attends. The
layers are written out as in ``DecodeStep`` (transformers' own norm, rotary and projection modules), for the
models it describes. Matmuls get rows in multiples of ``partition_attention.ROW_MULTIPLE``, so in float32 and
bfloat16 a request's logits have the same bits packed with others as packed alone (int8 and int4 only while neither
has more than ``weights.KERNEL_ROWS`` rows: past that the linear layers take the dense copy, not the fused kernels,
and round differently). Requests with a recovery refresh prefill alone (``executor.prefill``). This module knows
nothing about PML, chunks or scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from pc_rag.attention import FLASH_CPU, attend_after_cache
from pc_rag.kv import KVBuffer
from pc_rag.runtime.decode_step import FusedLayer, built_once, rms_norm
from pc_rag.runtime.partition_attention import padded_rows


@dataclass(frozen=True)
class PrefillJob:
    """One request's new tokens at their positions, after ``length`` entries spliced into ``buffer``."""

    buffer: KVBuffer
    length: int
    ids: Sequence[int]
    positions: Sequence[int]


class BatchPrefill:
    """``prefill(jobs)``: the logits [V] after each job's last new token; its new tokens' KV lands in its buffer."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self._decoder = model.get_decoder()
        self._layers = [FusedLayer(layer) for layer in self._decoder.layers]

    @classmethod
    def of(cls, model: PreTrainedModel) -> BatchPrefill | None:
        """The model's packed prefill, built once per model; None when it would not equal the model's forward."""
        return built_once(cls, model)

    @torch.inference_mode()
    def __call__(self, jobs: Sequence[PrefillJob]) -> list[torch.Tensor]:
        assert jobs and all(job.ids for job in jobs), "every job has new tokens"
        device = jobs[0].buffer.keys.device
        ids = torch.tensor([t for job in jobs for t in job.ids], device=device)
        positions = torch.tensor([p for job in jobs for p in job.positions], device=device)
        total = ids.shape[0]
        padded = padded_rows(total)
        index = torch.cat([torch.arange(total, device=device), ids.new_zeros(padded - total)])
        decoder = self._decoder
        x = decoder.embed_tokens(ids[index])[None]  # [1, padded, hidden]; rows past `total` repeat row 0
        rotary = decoder.rotary_emb(x, positions[index][None])
        bounds, start = [], 0
        for job in jobs:
            bounds.append((start, start + len(job.ids)))
            start += len(job.ids)
        for layer_index, layer in enumerate(self._layers):
            x = _layer(layer, layer_index, x, rotary, jobs, bounds, total)
        last = torch.tensor([end - 1 for _, end in bounds], device=device)
        rows = torch.cat([last, last.new_full((padded_rows(len(jobs)) - len(jobs),), int(last[0]))])
        logits = self._model.lm_head(rms_norm(decoder.norm, x[0, rows]))
        return list(logits[: len(jobs)])


def _layer(
    layer: FusedLayer, index: int, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
    jobs: Sequence[PrefillJob], bounds: Sequence[tuple[int, int]], total: int,
) -> torch.Tensor:  # fmt: skip
    """One decoder layer over the packed rows ``x`` [1, padded, hidden]; attention per job over its buffer. The
    projections take the dense layers, never the fused kernels, at any row count."""
    padded = x.shape[1]
    q, k, v = layer.project(x, rotary, fused=False)  # [1, H(_kv), padded, D]
    outs = []
    for job, (a, b) in zip(jobs, bounds, strict=True):
        keys, values = job.buffer.keys[index], job.buffer.values[index]  # [1, H_kv, capacity, D]
        end = job.length + b - a
        keys[:, :, job.length : end] = k[:, :, a:b]
        values[:, :, job.length : end] = v[:, :, a:b]
        scale = layer.layer.self_attn.scaling
        outs.append(_attend(q[:, :, a:b], keys[:, :, :end], values[:, :, :end], scale))  # [1, n, H, D]
    out = torch.cat([*outs, outs[0][:, :1].expand(-1, padded - total, -1, -1)], dim=1)
    return layer.finish(x, out.reshape(1, padded, -1), fused=False)


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """New tokens ``query`` [1, H, n, D] after the cache: the cache, then themselves causally -> [1, n, H, D].
    The CPU path is the one a prefill alone takes (``attention.attend_after_cache``)."""
    n, length = query.shape[2], keys.shape[2]
    if FLASH_CPU is not None and query.device.type == "cpu" and 1 < n < length:
        return attend_after_cache(query, keys, values, scale)
    allowed = (
        torch.arange(length, device=query.device)[None]
        <= torch.arange(length - n, length, device=query.device)[:, None]
    )
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)
