"""Compute the KV of spans: one forward per batch of spans, each after an optional shared context.

Encoding in isolation (the paper's default) means a span attends only to its own
tokens and to its ``context`` (the schema's leading anonymous text). Spans in a
batch never see each other: they sit in separate batch rows, right-padded, so
causal masking hides the padding. This module knows nothing about PML.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from pc_rag.kv import SpanKV, allocate
from pc_rag.runtime.model_call import with_cache


@torch.inference_mode()
def encode_spans(
    model: PreTrainedModel,
    spans: Sequence[tuple[Sequence[int], Sequence[int]]],
    context: SpanKV | None = None,
) -> list[SpanKV]:
    """Encode ``spans`` (token ids, absolute positions) in one batch, each attending to ``context`` and itself."""
    if not spans:
        return []
    device = next(model.parameters()).device
    width = max(len(ids) for ids, _ in spans)
    ctx_len = context.length if context is not None else 0
    buffer = allocate(model, ctx_len + width, batch=len(spans))
    if context is not None:
        buffer.keys[:, :, :, :ctx_len] = context.keys.unsqueeze(1).to(buffer.keys)
        buffer.values[:, :, :, :ctx_len] = context.values.unsqueeze(1).to(buffer.values)
    ids = torch.zeros(len(spans), width, dtype=torch.long)
    positions = torch.zeros(len(spans), width, dtype=torch.long)
    for row, (span_ids, span_positions) in enumerate(spans):
        n = len(span_ids)
        ids[row, :n] = torch.as_tensor(span_ids)
        positions[row, :n] = torch.as_tensor(span_positions)
        if n < width:  # padding continues the positions; causal masking keeps it invisible
            positions[row, n:] = torch.arange(1, width - n + 1) + (positions[row, n - 1] if n else 0)
    model.get_decoder()(
        input_ids=ids.to(device),
        position_ids=positions.to(device),
        **with_cache(buffer.cache(ctx_len)),
        use_cache=True,
    )
    out = []
    for row, (span_ids, _) in enumerate(spans):
        n = len(span_ids)
        keys = buffer.keys[:, row, :, ctx_len : ctx_len + n].clone()
        values = buffer.values[:, row, :, ctx_len : ctx_len + n].clone()
        out.append(SpanKV(keys, values, positions[row, :n].clone()))
    return out
