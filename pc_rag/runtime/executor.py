"""Run one request on its own: acquire a buffer, splice, recover, forward the new tokens, decode, release.

``prefill`` is the part every way of serving shares (the ``Scheduler`` calls it too, then decodes the request
in a batch); ``execute`` adds decoding the request alone and, when asked, teacher-forced scoring. This module
knows nothing about PML, chunks or retrieval: it runs ``Request`` objects.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from pc_rag.assemble import forward_new_tokens, splice
from pc_rag.errors import ContextLengthError
from pc_rag.kv import BufferPool, KVBuffer
from pc_rag.model import LoadedModel
from pc_rag.recompute import recompute_and_prefill
from pc_rag.runtime.generate import GenerationResult, decode_tokens, run_generation
from pc_rag.runtime.model_call import ModelCall, with_cache
from pc_rag.runtime.model_runner import ModelRunner, padded_count
from pc_rag.runtime.request import Request
from pc_rag.runtime.threads import adapt_threads


@dataclass
class Prefilled:
    """A request after its prefill: ``buffer`` holds ``length`` entries (parts, refreshed in place at ``recomputed``,
    then the new tokens), ``logits`` [V] predict the first generated token."""

    request: Request
    buffer: KVBuffer
    cache: Cache
    length: int
    logits: torch.Tensor
    recomputed: list[int]

    @property
    def counts(self) -> tuple[int, int]:
        """(cached, computed) tokens of the prompt."""
        request = self.request
        computed = len(self.recomputed) + len(request.new_ids) + request.own_tokens
        return self.length - computed, computed


def check_length(lm: LoadedModel, next_position: int) -> None:
    """Refuse a prompt whose first generated token, at ``next_position``, would not fit the model's positions."""
    if next_position + 1 > lm.max_positions:
        msg = f"prompt reaches position {next_position}: it exceeds the model's {lm.max_positions} positions"
        raise ContextLengthError(msg)


def splice_request(lm: LoadedModel, buffers: BufferPool, request: Request) -> tuple[KVBuffer, int]:
    """A pooled buffer with room for the whole reply, the request's parts spliced into it, and their length.

    The caller releases the buffer (``buffers.release``)."""
    check_length(lm, request.next_position)
    new, runner = len(request.new_ids), ModelRunner.of(lm.model)
    buffer = buffers.acquire(request.spliced + max(padded_count(new), new + request.params.max_new_tokens))
    try:
        runner.prepare(buffer)  # a new buffer's buckets are captured now, before its first timed forward
        return buffer, splice(buffer, lm.rope, [(part.kv, part.shift) for part in request.parts])
    except BaseException:
        buffers.release(buffer)
        raise


def prefill(lm: LoadedModel, buffers: BufferPool, request: Request) -> Prefilled:
    """Splice the request's parts into a pooled buffer, recompute what its refresh chooses, run its new tokens.

    The caller releases the buffer (``buffers.release(prefilled.buffer)``)."""
    adapt_threads()
    buffer, spliced = splice_request(lm, buffers, request)
    try:
        refresh = request.refresh
        chosen = refresh.choose(buffer, spliced) if refresh is not None else []
        call = request.calls.first(chosen)
        if chosen:
            assert refresh is not None
            logits, cache = recompute_and_prefill(
                lm.model, buffer, spliced, chosen, refresh.token_ids(chosen), refresh.positions(chosen),
                request.new_ids, request.new_positions, call=call,
            )  # fmt: skip
        elif call.is_plain:  # the one runner: static shapes and CUDA graphs on a GPU
            logits, cache = ModelRunner.of(lm.model).forward(buffer, spliced, request.new_ids, request.new_positions)
        else:
            logits, cache = forward_new_tokens(
                lm.model, buffer, spliced, request.new_ids, request.new_positions, call=call
            )
    except BaseException:
        buffers.release(buffer)
        raise
    return Prefilled(request, buffer, cache, spliced + len(request.new_ids), logits, chosen)


def execute(
    lm: LoadedModel, buffers: BufferPool, request: Request, stop_ids: frozenset[int]
) -> Iterator[str | GenerationResult]:
    """Serve ``request`` alone: text deltas as they are decoded, then the ``GenerationResult``."""
    done = prefill(lm, buffers, request)
    try:
        later = request.calls.later(done.recomputed)
        params = request.params
        tokens = decode_tokens(
            lm.model, done.cache, done.logits, request.next_position, params, stop_ids, later, request.context_ids
        )
        stream = run_generation(tokens, lm.tokenizer, params, request.watch, done.logits, *done.counts)
        if request.reference_ids is not None:
            forced = (done.length, request.next_position, request.reference_ids)
            stream = _teacher_forced(stream, lm.model, done.buffer, *forced, later)
        yield from stream
    finally:
        buffers.release(done.buffer)


def _teacher_forced(
    stream: Iterator[str | GenerationResult],
    model: PreTrainedModel,
    buffer: KVBuffer,
    prompt_length: int,
    next_position: int,
    reference_ids: Sequence[int],
    call: ModelCall,
) -> Iterator[str | GenerationResult]:
    """``stream`` whose result carries ``step_logits`` [1 + len(reference_ids), V] forced with ``reference_ids``.

    Runs once the result exists (the clock has stopped), before the buffer is released: the cache is taken back
    to the prompt's ``prompt_length`` entries and one forward runs ``reference_ids`` at the positions from
    ``next_position``, overwriting the generated tokens' KV. Row j holds the logits given the
    prompt and ``reference_ids[:j]``; row 0 is ``first_logits``.
    """
    for item in stream:
        if isinstance(item, GenerationResult):
            rows = [item.first_logits[None]]  # [1, V], float32 on the CPU
            if reference_ids:
                rows.append(_forward_all(model, buffer, prompt_length, next_position, reference_ids, call))
            item = replace(item, step_logits=torch.cat(rows))
        yield item


@torch.inference_mode()
def _forward_all(
    model: PreTrainedModel, buffer: KVBuffer, length: int, position: int, ids: Sequence[int], call: ModelCall
) -> torch.Tensor:
    """Logits [len(ids), V] (float32, CPU) of ``ids`` run at positions from ``position`` after ``length`` cached
    tokens."""
    device = buffer.keys.device
    out = call(
        model,
        input_ids=torch.tensor([list(ids)], device=device),
        position_ids=torch.arange(position, position + len(ids), device=device)[None],
        **with_cache(buffer.cache(length)),
        use_cache=True,
    )
    return out.logits[0].float().cpu()
