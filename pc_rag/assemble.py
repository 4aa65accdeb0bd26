"""Splice cached spans into one preallocated cache, re-rotating keys that move.

Each span is copied once into a buffer sized for the whole request (spliced
spans + computed tokens + generated tokens): no per-module, per-layer
``torch.cat``. This module knows nothing about PML or sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from pc_rag.kv import KVBuffer, SpanKV
from pc_rag.rope import RopeSpec
from pc_rag.runtime.model_call import PLAIN, ModelCall, with_cache


def splice(buffer: KVBuffer, rope: RopeSpec, parts: Sequence[tuple[SpanKV, int]]) -> int:
    """Copy ``parts`` (span, position delta) one after another into ``buffer``; return the filled length.

    A span with ``delta != 0`` has its keys rotated by ``delta`` positions, i.e. it
    lands at ``positions + delta``; values are position-free and copied as is.
    """
    offset = 0
    for kv, delta in parts:
        end = offset + kv.length
        keys = kv.keys.to(buffer.keys.device, buffer.keys.dtype, non_blocking=True)
        values = kv.values.to(buffer.values.device, buffer.values.dtype, non_blocking=True)
        if delta:
            rope.rotate_into(buffer.keys[:, 0, :, offset:end], keys, delta)
        else:
            buffer.keys[:, 0, :, offset:end] = keys
        buffer.values[:, 0, :, offset:end] = values
        offset = end
    return offset


def move(kv: SpanKV, rope: RopeSpec, delta: int) -> SpanKV:
    """The same span ``delta`` positions later (keys re-rotated)."""
    return SpanKV(rope.rotate_all(kv.keys, delta), kv.values, kv.positions + delta)


@torch.inference_mode()
def forward_new_tokens(
    model: PreTrainedModel,
    buffer: KVBuffer,
    length: int,
    ids: Sequence[int],
    positions: Sequence[int],
    call: ModelCall = PLAIN,
) -> tuple[torch.Tensor, object]:
    """Run ``ids`` at ``positions`` after ``length`` cached tokens; return last-position logits [V] and the cache."""
    device = buffer.keys.device
    cache = buffer.cache(length)
    out = call(
        model,
        input_ids=torch.tensor([list(ids)], device=device),
        position_ids=torch.tensor([list(positions)], device=device),
        **with_cache(cache),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[0, -1], cache
