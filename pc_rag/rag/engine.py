"""Answer a question from retrieved chunk modules: splice, re-rotate, recover, decode.

Chunks are encoded once at a canonical start position (alone, or after the
shared preamble). At query time they are laid out one after another after the
preamble, a schema with no union where every chunk is its own span; their keys
are re-rotated to those slots, the recovery mode recomputes the tokens it
chooses, and the question is computed after them. This engine knows nothing
about retrieval, embeddings or storage: it receives chunks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import cached_property, partial
from uuid import uuid4

import torch

from pc_rag.baseline import full_request, serve_full
from pc_rag.calibration import KWARG as SEGMENTS
from pc_rag.calibration import Calibration, Segments
from pc_rag.chat import ChatWrappers, chat_wrappers
from pc_rag.encode import encode_spans
from pc_rag.errors import PCRagError
from pc_rag.kv import BufferPool, KVBuffer, SpanKV
from pc_rag.model import LoadedModel
from pc_rag.rag.adapter import SpliceAdapter
from pc_rag.rag.chunk import Chunk, ChunkEncodingError, encoder_mismatch, mode_mismatch
from pc_rag.rag.modes import ADAPTER_FREE_MODE, DEFAULT_MODE, RecoveryMode, resolve_mode
from pc_rag.rag.prompt import RagPrompt
from pc_rag.rag.query_layout import Piece, QueryLayout, layout_query
from pc_rag.rag.query_select import query_indices, question_attention
from pc_rag.rag.select import deviation_indices, edge_indices, kv_deviation
from pc_rag.rag.tuned import Tuned, use_answer_phrases
from pc_rag.runtime.executor import execute
from pc_rag.runtime.generate import (
    GenerationResult,
    ReplyStream,
    SamplingParams,
    Stopwatch,
    collect,
    eos_ids,
)
from pc_rag.runtime.model_call import ModelCall
from pc_rag.runtime.prefix_cache import PrefixCache
from pc_rag.runtime.request import Part, Refresh, Request
from pc_rag.runtime.shared_pool import SegmentKey

ENCODE_BATCH = 8

logger = logging.getLogger(__name__)


class RagEngine:
    """Serve ``prompt.head + chunks + question`` with chunk KV reused across questions.

    ``canonical_gap`` is the distance between the end of the preamble and the
    canonical start of conditioned chunks: a chunk that saw the preamble from a
    typical distance re-rotates to its slot better than one encoded right after it.

    Concurrency: ``answer``, ``stream`` and ``encode`` may be called from many threads at once. The model is
    shared read-only (no request swaps or hooks a module: recovery probes pass their state as attention
    kwargs, the splice adapter acts through a per-thread context variable), and each request takes its
    own KV buffer from a locked pool. Each request runs its own forwards; batching requests together is
    the serving issue's.
    """

    def __init__(
        self,
        lm: LoadedModel,
        prompt: RagPrompt | None = None,
        *,
        canonical_gap: int = 512,
        kv_device: str | torch.device | None = None,
        kv_dtype: torch.dtype | None = None,
        adapter: SpliceAdapter | None = None,
        calibration: Calibration | None = None,
    ) -> None:
        self.lm = lm
        self.tuned = Tuned(lm)  # the adapter and calibration of modes that use them, loaded on first use
        self.tuned.use(adapter, calibration)
        self.prompt = prompt or RagPrompt()
        self.wrappers = _wrappers(lm)
        self.kv_device = torch.device(kv_device) if kv_device is not None else lm.device
        self.kv_dtype = kv_dtype or lm.dtype
        self.head_text = self.prompt.head(self.wrappers)
        self.head_ids = tuple(self.tokenize(self.head_text))
        self.head_kv = encode_spans(lm.model, [(self.head_ids, range(len(self.head_ids)))])[0]
        # the preamble's KV as requests may share it: this engine's encoding, at positions 0...
        self._head_key = SegmentKey(f"rag-preamble/{uuid4().hex}", self.head_ids, tuple(range(len(self.head_ids))))
        self.canonical_start = len(self.head_ids) + canonical_gap
        self.stop_ids = eos_ids(lm.model, lm.tokenizer)  # the tokens that end an answer
        self._buffers = BufferPool(lm.model)
        use_answer_phrases(lm)  # a second draft source for speculative decoding, where the model has one

    @cached_property
    def default_mode(self) -> str:
        """The mode of a new store and of calls given none: ``DEFAULT_MODE``, or ``ADAPTER_FREE_MODE`` when the
        model has no trained splice adapter (said once, as a warning)."""
        if self.tuned.has_adapter():
            return DEFAULT_MODE
        logger.warning(
            "no trained splice adapter for model %r (fingerprint %s): the default mode is %r instead of %r; "
            "make one with `pc-rag tune`", self.lm.name, self.lm.fingerprint(), ADAPTER_FREE_MODE, DEFAULT_MODE,
        )  # fmt: skip
        return ADAPTER_FREE_MODE

    def tokenize(self, text: str) -> list[int]:
        return self.lm.tokenizer(text, add_special_tokens=False)["input_ids"]

    def passage_text(self, index: int, title: str, text: str) -> str:
        """A document as the prompt shows it (``index`` is 1-based)."""
        return self.prompt.passage(index, title, text)

    def encode(self, texts: Sequence[str], mode: str | RecoveryMode | None = None) -> list[Chunk]:
        """Encode ``texts`` as chunks the way ``mode`` (default: ``default_mode``) wants them (alone or after the
        preamble; by the splice adapter's encoding side if the mode applies an adapter that has one), in batches."""
        resolved = self._mode(mode)
        ids = [self.tokenize(t) for t in texts]
        return self.encode_token_ids(ids, resolved.conditioned, texts, encoder=self.chunk_encoder(resolved))

    def chunk_encoder(self, mode: str | RecoveryMode | None = None) -> str:
        """How ``mode`` wants chunks encoded: the ``encoding_digest`` of the splice adapter it applies, or empty for
        the plain model (modes without an adapter, and adapters without an encoding side)."""
        resolved = self._mode(mode)
        return self.tuned.adapter().encoding_digest if resolved.adapter else ""

    def encode_token_ids(
        self,
        token_ids: Sequence[Sequence[int]],
        conditioned: bool,
        texts: Sequence[str] | None = None,
        *,
        encoder: str = "",
    ) -> list[Chunk]:
        """Encode already tokenized chunks; ``texts`` default to their decoding. ``encoder`` (a ``chunk_encoder``)
        names the splice adapter encoding side to encode with: it must be this model's adapter's."""
        if any(not ids for ids in token_ids):
            msg = "cannot encode an empty chunk"
            raise PCRagError(msg)
        self.check_can_encode(encoder)
        encoding = self.tuned.adapter().encoding_applied if encoder else nullcontext
        context = self.head_kv if conditioned else None
        start = self.canonical_start
        out: dict[int, Chunk] = {}
        order = sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]))  # similar lengths: little padding
        for b in range(0, len(order), ENCODE_BATCH):
            batch = order[b : b + ENCODE_BATCH]
            spans = [(token_ids[i], range(start, start + len(token_ids[i]))) for i in batch]
            with encoding():
                encoded = encode_spans(self.lm.model, spans, context)
            for i, kv in zip(batch, encoded, strict=True):
                ids = tuple(token_ids[i])
                text = texts[i] if texts is not None else self.lm.tokenizer.decode(ids)
                out[i] = Chunk(text, ids, kv.to(self.kv_device, self.kv_dtype), conditioned, encoder=encoder)
        return [out[i] for i in range(len(token_ids))]

    def check_can_encode(self, encoder: str, store: str = "STORE") -> None:
        """``ChunkEncodingError`` unless this model can encode chunks by ``encoder`` (a ``chunk_encoder``; non-empty:
        its adapter's encoding side must be that one), naming the command that re-encodes ``store``."""
        now = self.tuned.adapter().encoding_digest if encoder else ""
        if now != encoder:
            raise ChunkEncodingError(encoder_mismatch(encoder, now, store))

    def check_encoding(self, chunks: Sequence[Chunk], mode: str | RecoveryMode | None = None) -> None:
        """``ChunkEncodingError`` unless every chunk was encoded as ``mode`` reads chunks (``chunk_encoder``)."""
        resolved = self._mode(mode)
        wanted = self.chunk_encoder(resolved) if chunks else ""
        wrong = next((c for c in chunks if c.encoder != wanted), None)
        if wrong is not None:
            store = wrong.source is not None and wrong.source.startswith("store/")
            what = f"store chunk {wrong.text[:40]!r} was" if store else "a chunk was"
            raise ChunkEncodingError(mode_mismatch(what, wrong.encoder, wanted, resolved.name))

    def full_ids(self, chunks: Sequence[Chunk], question: str) -> list[int]:
        """The plain prompt: head, chunk tokens and question tokens, tokenized piecewise."""
        return self.layout(chunks, question).full_ids()

    def plain_ids(self, texts: Sequence[str], question: str) -> list[int]:
        """``full_ids`` of the chunks of ``texts``, without encoding them."""
        chunks = [(text, self.tokenize(text)) for text in texts]
        return layout_query((self.head_text, self.head_ids), chunks, self._tail(question)).full_ids()

    def answer(
        self,
        chunks: Sequence[Chunk],
        question: str,
        mode: str | RecoveryMode | None = None,
        *,
        reference_ids: Sequence[int] | None = None,
        **kwargs: object,
    ) -> GenerationResult:
        """Answer from cached chunks with ``mode``'s recovery (default: ``default_mode``); kwargs are
        ``SamplingParams`` fields.

        With ``reference_ids`` the result's ``step_logits`` [1 + len(reference_ids), V] are teacher-forced:
        row j holds this mode's logits given its own cached prompt and ``reference_ids[:j]`` (row 0 is
        ``first_logits``). They are computed after the answer is timed, on its cache; the answer is unchanged.
        """
        pieces = self._pieces(chunks, question)
        return collect(self._serve(pieces, self._mode(mode), reference_ids=reference_ids, **kwargs))

    def stream(
        self, chunks: Sequence[Chunk], question: str, mode: str | RecoveryMode | None = None, **kwargs: object
    ) -> ReplyStream:
        """Like ``answer``, streaming text deltas; ``.result`` is set at the end."""
        return ReplyStream(self._serve(self._pieces(chunks, question), self._mode(mode), **kwargs))

    def answer_full(
        self, chunks: Sequence[Chunk], question: str, *, reuse_preamble: bool = False, **kwargs: object
    ) -> GenerationResult:
        """Baseline: full prefill of the same tokens, then the same decoding.

        ``reuse_preamble=True`` is prefix caching: the preamble's KV is reused, chunks and question computed.
        """
        ids = self.layout(chunks, question).full_ids()
        return collect(self._serve_full(ids, self.head_kv if reuse_preamble else None, **kwargs))

    def stream_around(
        self,
        before: str,
        chunks: Sequence[Chunk],
        after: str,
        mode: str | RecoveryMode | None,
        **kwargs: object,
    ) -> ReplyStream:
        """Serve a user turn of free text ``before`` the chunks and ``after`` them (the question).

        ``before`` equal to the prompt's preamble reuses its cached KV; other text is
        computed for this request (the chunks were still encoded after the preamble).
        ``mode=None`` serves the same tokens by full prefill. Without chunks the turn is
        plain text and is always served by full prefill.
        """
        return self.serve(self.request_around(before, chunks, after, mode, **kwargs))

    def request_around(
        self,
        before: str,
        chunks: Sequence[Chunk],
        after: str,
        mode: str | RecoveryMode | None,
        **kwargs: object,
    ) -> Request:
        """``stream_around``'s turn as a serving ``Request``."""
        pieces = self._pieces_around(before, chunks, after)
        if mode is None or not chunks:
            params = replace(SamplingParams(), **self._with_stop(kwargs))  # type: ignore[arg-type]
            return full_request(pieces.layout().full_ids(), params)
        return self._request(pieces, resolve_mode(mode), **kwargs)

    def stream_ids(self, ids: Sequence[int], **kwargs: object) -> ReplyStream:
        """Full prefill of plain token ids (no reuse), then decoding: any conversation rendered by the caller."""
        return ReplyStream(self._serve_full(ids, None, **kwargs))

    def serve(self, request: Request) -> ReplyStream:
        """Serve a ``Request`` of this engine alone (``serving.execute``); a ``Scheduler`` batches them instead."""
        return ReplyStream(execute(self.lm, self._buffers, request, self.stop_ids))

    def layout(self, chunks: Sequence[Chunk], question: str) -> QueryLayout:
        """The answer's prompt as a union-free schema prompt, laid out and planned (``rag.query_layout``)."""
        return self._pieces(chunks, question).layout()

    def _pieces(self, chunks: Sequence[Chunk], question: str) -> _Pieces:
        return _Pieces((self.head_text, self.head_ids), self.head_kv, tuple(chunks), self._tail(question))

    def _tail(self, question: str) -> Piece:
        text = self.prompt.tail(self.wrappers, question)
        return text, self.tokenize(text)

    def _pieces_around(self, before: str, chunks: Sequence[Chunk], after: str) -> _Pieces:
        if before == self.prompt.preamble:
            head, head_kv = (self.head_text, self.head_ids), self.head_kv
        else:
            text = self.prompt.head(self.wrappers, before)
            head, head_kv = (text, tuple(self.tokenize(text))), None
        tail = after + self.wrappers.close["user"] + self.wrappers.generation_prompt
        return _Pieces(head, head_kv, tuple(chunks), (tail, self.tokenize(tail)))

    def _serve_full(
        self, ids: Sequence[int], prefix: SpanKV | None, **kwargs: object
    ) -> Iterator[str | GenerationResult]:
        params = replace(SamplingParams(), **self._with_stop(kwargs))  # type: ignore[arg-type]
        return serve_full(self.lm, self._buffers, ids, params, self.stop_ids, prefix)

    def request(
        self, chunks: Sequence[Chunk], question: str, mode: str | RecoveryMode | None = None, **kwargs: object
    ) -> Request:
        """The answer to ``question`` from ``chunks`` as a serving ``Request`` (for ``serving.execute`` or a
        ``Scheduler``); kwargs are ``SamplingParams`` fields. Its clock starts now."""
        return self._request(self._pieces(chunks, question), self._mode(mode), **kwargs)

    def request_chat(
        self,
        system: str | None,
        history: Sequence[tuple[str, str]],
        chunks: Sequence[Chunk],
        question: str,
        mode: str | RecoveryMode | None = None,
        *,
        around: tuple[str, str] | None = None,
        prefix_cache: PrefixCache | None = None,
        **kwargs: object,
    ) -> Request:
        """The answer to the last user turn ``question`` of a conversation from ``chunks``: ``system`` (None: ours),
        the earlier ``(role, text)`` turns, then the documents and the question (``RagPrompt.conversation_head``).
        ``around``: the last turn's own text before and after the documents, in place of the preamble and the
        question template (a turn that carried module references). The head's KV comes from ``prefix_cache``
        where an earlier turn computed it; the rest is computed now."""
        if not history and system is None and around is None:
            return self.request(chunks, question, mode, **kwargs)
        before, after = around if around is not None else (None, None)
        text = self.prompt.conversation_head(self.wrappers, system, history, before)
        ids = tuple(self.tokenize(text))
        if after is None:
            tail = self._tail(question)
        else:
            tail_text = after + self.wrappers.close["user"] + self.wrappers.generation_prompt
            tail = (tail_text, self.tokenize(tail_text))
        if prefix_cache is None:
            return self._request(_Pieces((text, ids), None, tuple(chunks), tail), self._mode(mode), **kwargs)
        head = prefix_cache.encode(self.lm.model, ids)
        pieces = _Pieces((text, ids), head.kv, tuple(chunks), tail)
        return self._request(pieces, self._mode(mode), own_tokens=head.computed, **kwargs)

    def request_full(self, chunks: Sequence[Chunk], question: str, **kwargs: object) -> Request:
        """``request``'s tokens served by full prefill (the baseline), ending as ``request`` does (stop texts)."""
        params = replace(SamplingParams(), **self._with_stop(kwargs))  # type: ignore[arg-type]
        return full_request(self.full_ids(chunks, question), params)

    def _with_stop(self, kwargs: dict[str, object]) -> dict[str, object]:
        """``kwargs`` with the wrappers' stop texts (a base model's reply ends at a line break) unless given."""
        return kwargs if "stop" in kwargs or not self.wrappers.stop else {**kwargs, "stop": self.wrappers.stop}

    def _mode(self, mode: str | RecoveryMode | None) -> RecoveryMode:
        return resolve_mode(self.default_mode if mode is None else mode)

    def _serve(
        self, pieces: _Pieces, mode: RecoveryMode, reference_ids: Sequence[int] | None = None, **kwargs: object
    ) -> Iterator[str | GenerationResult]:
        request = self._request(pieces, mode, reference_ids, **kwargs)
        yield from execute(self.lm, self._buffers, request, self.stop_ids)

    def _request(
        self,
        pieces: _Pieces,
        mode: RecoveryMode,
        reference_ids: Sequence[int] | None = None,
        *,
        own_tokens: int = 0,
        **kwargs: object,
    ) -> Request:
        """``own_tokens``: tokens of a given head computed for this request (a history's new turns)."""
        params = replace(SamplingParams(), **self._with_stop(kwargs))  # type: ignore[arg-type]
        watch = Stopwatch()
        self.check_encoding(pieces.chunks, mode)
        query = pieces.layout()
        chunks, plan, head, total = pieces.chunks, query.plan, query.head, query.chunks_end
        tail = plan.new_ids
        if pieces.head_kv is None:  # a preamble of this request's own: computed now, counted in TTFT
            head_kv = encode_spans(self.lm.model, [(pieces.head[1], range(head))])[0]
            head_part, own_tokens = Part(head_kv), head
        elif pieces.head_kv is self.head_kv:
            head_part = Part(pieces.head_kv, share=self._head_key)
        else:  # a conversation's head, from the prefix cache
            head_part = Part(pieces.head_kv)
        slots = query.slots()
        moved = [self._chunk_part(c, start) for c, (start, _) in zip(chunks, slots, strict=True)]
        ids = [t for c in chunks for t in c.token_ids]
        calls = _QueryCalls(self.tuned, mode, head, total)
        refresh = None
        if mode.recomputes and ids:
            refresh = Refresh(
                choose=lambda buffer, _: self._select(mode, buffer, head, slots, ids, total, tail, calls),
                token_ids=lambda chosen: [ids[i - head] for i in chosen],
                positions=list,  # cache index = position: the chunks follow the head without gaps
            )
        return Request(
            [head_part, *moved], tail, plan.new_positions, plan.next_position, params, refresh, calls,
            own_tokens=own_tokens, reference_ids=reference_ids, watch=watch,
            context_ids=[*pieces.head[1], *ids, *tail],
        )  # fmt: skip

    def _chunk_part(self, chunk: Chunk, start: int) -> Part:
        """``chunk`` re-rotated to ``start``; shared with other requests that place the same chunk there (its KV
        after the shift depends only on its source and positions) unless recovery recomputes some of it."""
        shift = start - int(chunk.kv.positions[0])
        if chunk.source is None:
            return Part(chunk.kv, shift)
        key = SegmentKey(f"rag-chunk/{chunk.source}", chunk.token_ids, tuple(range(start, start + chunk.kv.length)))
        return Part(chunk.kv, shift, share=key)

    def _select(
        self,
        mode: RecoveryMode,
        buffer: KVBuffer,
        head: int,
        slots: Sequence[tuple[int, int]],
        ids: Sequence[int],
        total: int,
        tail: Sequence[int],
        calls: _QueryCalls,
    ) -> list[int]:
        """Cache indices to recompute (sorted): edge tokens, then the question's most attended chunk tokens
        (``selection == "query"``), the largest KV deviations (``"deviation"``), or the largest products of
        the two (``"blend"``)."""
        if mode.selection in ("query", "blend") and mode.ratio > 0 and ids:
            positions = range(total, total + len(tail))
            scores = question_attention(
                self.lm.model, buffer, total, tail, positions, mode.query_layers, call=calls.first([])
            )
            if mode.selection == "blend":  # attention x value change, as the oracle that sees full prefill
                deviation = kv_deviation(self.lm.model, buffer, head, ids, range(head, total), mode.probe_layer)
                scores = torch.cat((scores[:head], scores[head:total] * deviation.to(scores)))
            return query_indices(scores, slots, mode.ratio, mode.window, mode.edge)
        chosen = set(edge_indices(slots, mode.edge))
        if mode.ratio > 0 and ids:
            chosen.update(deviation_indices(self.lm.model, buffer, head, ids, mode.ratio, mode.probe_layer, chosen))
        return sorted(chosen)


class _QueryCalls:
    """The model calls of one request's query-time tokens under ``mode``: adapter applied, attention calibrated."""

    def __init__(self, tuned: Tuned, mode: RecoveryMode, head: int, total: int) -> None:
        self._adapter = tuned.adapter() if mode.adapter else None
        self._skips_recomputed = mode.adapter_skips_recomputed
        self._calibration = tuned.calibration() if mode.calibrated else None
        self._chunks = (head, total)  # cache indices [head, total) hold the spliced chunks

    def first(self, recomputed: Sequence[int]) -> ModelCall:
        """The forward of the recomputed tokens (which attend exactly) followed by the question."""
        return self._call(recomputed, exact_rows=len(recomputed))

    def later(self, recomputed: Sequence[int]) -> ModelCall:
        """Decode steps and teacher-forced scoring: every row is a query-time token after the question."""
        return self._call(recomputed, exact_rows=0)

    def _call(self, recomputed: Sequence[int], exact_rows: int) -> ModelCall:
        context = nullcontext
        if self._adapter is not None:  # the recomputed rows lead the call: skip them if the mode says so
            context = partial(self._adapter.applied, exact_rows if self._skips_recomputed else 0)
        if self._calibration is None or self._calibration.is_identity:
            return ModelCall(context=context)
        index = torch.as_tensor(list(recomputed), dtype=torch.long)
        segments = Segments(*self._chunks, self._calibration, exact_rows, index)
        return ModelCall({SEGMENTS: segments}, context)


def _wrappers(lm: LoadedModel) -> ChatWrappers:
    """The chat template's role wrappers, or plain text for a base model that has none (said once, as a notice)."""
    if getattr(lm.tokenizer, "chat_template", None):
        return chat_wrappers(lm.tokenizer)
    logger.info("model %r has no chat template: the RAG prompt is plain text and replies end at a line break", lm.name)
    return ChatWrappers.plain()


@dataclass(frozen=True)
class _Pieces:
    """What one answer serves: the head (text and ids; its KV when cached), chunks, then the computed tail."""

    head: Piece
    head_kv: SpanKV | None
    chunks: tuple[Chunk, ...]
    tail: Piece

    def layout(self) -> QueryLayout:
        return layout_query(self.head, [(c.text, c.token_ids) for c in self.chunks], self.tail)
