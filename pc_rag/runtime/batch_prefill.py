"""Prefill several requests together, layer by layer: a layer's weights are read from memory once for all of them.

Each request has already spliced its parts into its own buffer. Per layer, each request's new tokens run through
the norms and projections in a call of their own (rows padded to a multiple of
``partition_attention.ROW_MULTIPLE``) while the layer's weights stay in cache, then attend over the request's own
buffer (cached entries, then its new tokens causally), as a prefill alone attends; the output projection takes the
last row padded the same way. So a request's calls have the shapes and inputs they have alone, and it gets the same
bits with others as alone in every dtype, whatever the GEMM library does with row counts. One call for all the
requests' rows would not: on a 2-core Xeon (AMX) the dense bfloat16 GEMM of an int4 model gave a row other bits
at 1,536 rows than at 96, and float32's at 16 rows than at 4 (``examples/gemm_row_bits.py``), which changed
answers of ``bench serve``. The layers are written out as in ``DecodeStep`` (transformers' own norm, rotary and
projection modules), for the models it describes. Requests with a recovery refresh prefill alone
(``executor.prefill``). This module knows nothing about PML, chunks or scheduling.
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
        decoder = self._decoder
        xs, rotaries = [], []
        for job in jobs:
            device = job.buffer.keys.device
            ids = _padded(torch.tensor(list(job.ids), device=device))
            x = decoder.embed_tokens(ids)[None]  # [1, padded, hidden]; rows past the job's repeat its first
            xs.append(x)
            rotaries.append(decoder.rotary_emb(x, _padded(torch.tensor(list(job.positions), device=device))[None]))
        for layer_index, layer in enumerate(self._layers):  # layer-major: its weights stay in cache for every job
            xs = [_layer(layer, layer_index, x, rotary, job) for x, rotary, job in zip(xs, rotaries, jobs, strict=True)]
        logits = []
        for x, job in zip(xs, jobs, strict=True):
            last = x[0, len(job.ids) - 1 : len(job.ids)].expand(padded_rows(1), -1)  # as a job alone: one row, padded
            logits.append(self._model.lm_head(rms_norm(decoder.norm, last.contiguous()))[0])
        return logits


def _padded(values: torch.Tensor) -> torch.Tensor:
    """``values`` [n] with its first entry repeated up to ``padded_rows(n)``."""
    pad = padded_rows(values.shape[0]) - values.shape[0]
    return torch.cat([values, values[:1].expand(pad)]) if pad else values


def _layer(
    layer: FusedLayer, index: int, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], job: PrefillJob
) -> torch.Tensor:
    """One decoder layer over one job's rows ``x`` [1, padded, hidden], attending over its buffer. The projections
    take the dense layers, never the fused kernels, at any row count."""
    padded, n = x.shape[1], len(job.ids)
    q, k, v = layer.project(x, rotary, fused=False)  # [1, H(_kv), padded, D]
    keys, values = job.buffer.keys[index], job.buffer.values[index]  # [1, H_kv, capacity, D]
    end = job.length + n
    keys[:, :, job.length : end] = k[:, :, :n]
    values[:, :, job.length : end] = v[:, :, :n]
    out = _attend(q[:, :, :n], keys[:, :, :end], values[:, :, :end], layer.layer.self_attn.scaling)  # [1, n, H, D]
    if padded > n:
        out = torch.cat([out, out[:, :1].expand(-1, padded - n, -1, -1)], dim=1)
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
