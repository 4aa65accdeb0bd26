"""Full prefill of plain token ids on the same runtime: the baseline every speedup is measured against.

Inference mode, SDPA attention, only the last position's logits, a pooled
preallocated cache, then the same decoding as cached serving: a ``Request`` with
no parts (or the shared prefix), run by the same executor. This module knows
nothing about modules or chunks: it receives token ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pc_rag.kv import BufferPool, SpanKV
from pc_rag.model import LoadedModel
from pc_rag.runtime.executor import execute
from pc_rag.runtime.generate import GenerationResult, SamplingParams
from pc_rag.runtime.request import Part, Request


def full_request(ids: Sequence[int], params: SamplingParams, prefix: SpanKV | None = None) -> Request:
    """Prefill ``ids`` and decode. With ``prefix`` (the KV of ``ids[:prefix.length]``, at positions from 0) only the
    rest is computed: what automatic prefix caching (vLLM, SGLang) gives a workload."""
    cached = prefix.length if prefix is not None else 0
    parts = [Part(prefix)] if prefix is not None else []
    return Request(parts, ids[cached:], range(cached, len(ids)), len(ids), params, context_ids=ids)


def serve_full(
    lm: LoadedModel,
    buffers: BufferPool,
    ids: Sequence[int],
    params: SamplingParams,
    stop_ids: frozenset[int],
    prefix: SpanKV | None = None,
) -> Iterator[str | GenerationResult]:
    """``full_request`` served alone; yields text deltas then the ``GenerationResult`` (the clock starts at the
    first ``next``, as for cached serving)."""
    yield from execute(lm, buffers, full_request(ids, params, prefix), stop_ids)
