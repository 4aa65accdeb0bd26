"""Full prefill of plain token ids on the same runtime: the baseline every speedup is measured against.

Inference mode, SDPA attention, only the last position's logits, a pooled
preallocated cache, then the same decoding as cached serving. This module
knows nothing about modules or chunks: it receives token ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pc_rag.assemble import forward_new_tokens, splice
from pc_rag.errors import ContextLengthError
from pc_rag.generate import GenerationResult, SamplingParams, Stopwatch, decode_tokens, run_generation
from pc_rag.kv import BufferPool, SpanKV
from pc_rag.model import LoadedModel


def serve_full(
    lm: LoadedModel,
    buffers: BufferPool,
    ids: Sequence[int],
    params: SamplingParams,
    stop_ids: frozenset[int],
    prefix: SpanKV | None = None,
) -> Iterator[str | GenerationResult]:
    """Prefill ``ids`` and decode; yields text deltas then the ``GenerationResult``.

    With ``prefix`` (the KV of ``ids[:prefix.length]``, at positions from 0) only the
    rest is computed: what automatic prefix caching (vLLM, SGLang) gives a workload.
    """
    if len(ids) + 1 > lm.max_positions:
        msg = f"prompt of {len(ids)} tokens exceeds the model's {lm.max_positions} positions"
        raise ContextLengthError(msg)
    watch = Stopwatch()
    buffer = buffers.acquire(len(ids) + params.max_new_tokens)
    try:
        cached = splice(buffer, lm.rope, [(prefix, 0)]) if prefix is not None else 0
        logits, cache = forward_new_tokens(lm.model, buffer, cached, ids[cached:], range(cached, len(ids)))
        tokens = decode_tokens(lm.model, cache, logits, len(ids), params, stop_ids)
        yield from run_generation(tokens, lm.tokenizer, params, watch, logits, cached, len(ids) - cached)
    finally:
        buffers.release(buffer)
