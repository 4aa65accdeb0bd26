"""The Prompt Cache engine: register schemas (encoding their modules once) and serve prompts.

Serving a prompt splices the KV of the modules it imports, computes only its
uncached tokens at their reserved positions, and decodes. ``generate_full`` is
the baseline: a full prefill of the same tokens on the same runtime. The engine
knows nothing about documents, retrieval or frameworks.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal
from uuid import uuid4

import torch

from pc_rag.baseline import serve_full
from pc_rag.chat import ChatWrappers, chat_wrappers
from pc_rag.encode import encode_spans
from pc_rag.errors import ContextLengthError, UnknownSchemaError
from pc_rag.kv import BufferPool, SpanKV, kv_shape
from pc_rag.layout import SchemaLayout, layout_schema
from pc_rag.model import LoadedModel
from pc_rag.plan import ServePlan, plan_prompt
from pc_rag.pml.nodes import Prompt, Role, Schema
from pc_rag.pml.parser import parse_prompt, parse_schema
from pc_rag.pml.validate import validate_prompt
from pc_rag.rag.tuned import use_answer_phrases
from pc_rag.runtime.executor import check_length, execute
from pc_rag.runtime.generate import (
    GenerationResult,
    ReplyStream,
    SamplingParams,
    Stopwatch,
    collect,
    eos_ids,
)
from pc_rag.runtime.request import Part, Request
from pc_rag.runtime.shared_pool import SegmentKey

logger = logging.getLogger(__name__)

Encoding = Literal["isolated", "scaffold"]
_ENCODE_BATCH = 8


@dataclass
class EncodedSchema:
    """A schema's layout and the KV of each span; ``scaffolds`` holds the jointly encoded variants."""

    layout: SchemaLayout
    kv: dict[str, SpanKV]
    scaffolds: dict[str, dict[str, SpanKV]] = field(default_factory=dict)
    uid: str = field(default_factory=lambda: uuid4().hex)  # this encoding, among every schema ever registered

    def share_key(self, name: str, joint: bool) -> SegmentKey:
        """The key under which requests share span ``name``'s KV (its jointly encoded variant if ``joint``)."""
        return self._share_keys[name, joint]

    @cached_property
    def _share_keys(self) -> dict[tuple[str, bool], SegmentKey]:
        # built once per schema: a request only looks its spans up (keys hash every token and position)
        keys = {}
        for name, span in self.layout.spans.items():
            variants = (False, True) if span.scaffold in self.scaffolds else (False,)
            for joint in variants:
                source = f"{self.uid}/{name}" + (f"@{span.scaffold}" if joint else "")
                keys[name, joint] = SegmentKey(source, tuple(span.token_ids), tuple(span.positions))
        return keys

    @property
    def nbytes(self) -> int:
        joint = sum(kv.nbytes for group in self.scaffolds.values() for kv in group.values())
        return sum(kv.nbytes for kv in self.kv.values()) + joint


@dataclass
class _Planned:
    """A prompt planned against its schema: the layout, the plan, and the spans' KV in cache order with the keys
    under which requests share them."""

    layout: SchemaLayout
    plan: ServePlan
    parts: list[SpanKV]
    share_keys: list[SegmentKey]


class PromptCache:
    """Serve PML prompts from precomputed module KV on one model.

    ``kv_device`` is where module KV is kept (default: the model's device; ``"cpu"``
    keeps it in host memory, pinned when CUDA is present). ``kv_dtype`` defaults to
    the model's dtype. Serving (``generate``, ``stream``) is thread-safe, as ``RagEngine``'s is;
    register schemas (``add_schema``) before serving them from other threads.
    """

    def __init__(
        self, lm: LoadedModel, *, kv_device: str | torch.device | None = None, kv_dtype: torch.dtype | None = None
    ) -> None:
        self.lm = lm
        self.kv_device = torch.device(kv_device) if kv_device is not None else lm.device
        self.kv_dtype = kv_dtype or lm.dtype
        self.schemas: dict[str, EncodedSchema] = {}
        self._stop_ids = eos_ids(lm.model, lm.tokenizer)
        self._buffers = BufferPool(lm.model)
        use_answer_phrases(lm)  # a second draft source for speculative decoding, where the model has one

    @cached_property
    def wrappers(self) -> ChatWrappers:
        return chat_wrappers(self.lm.tokenizer)

    def tokenize(self, text: str) -> list[int]:
        return self.lm.tokenizer(text, add_special_tokens=False)["input_ids"]

    @cached_property
    def _bos(self) -> list[int]:
        with_special = self.lm.tokenizer("x")["input_ids"]
        plain = self.tokenize("x")
        return with_special[: len(with_special) - len(plain)] if with_special[-len(plain) :] == plain else []

    def add_schema(self, schema: Schema | str) -> EncodedSchema:
        """Lay out ``schema`` (a ``Schema`` or PML text) and encode every span once; replaces a same-named schema."""
        if isinstance(schema, str):
            schema = parse_schema(schema)
        layout = layout_schema(schema, self.tokenize, lambda: self.wrappers, self._bos)
        if layout.length > self.lm.max_positions:
            msg = f"schema {schema.name!r} needs {layout.length} positions; the model has {self.lm.max_positions}"
            raise ContextLengthError(msg)
        encoded = EncodedSchema(layout=layout, kv=self._encode_isolated(layout))
        scaffolds = {s.scaffold for s in layout.spans.values() if s.scaffold}
        for name in sorted(scaffolds):
            encoded.scaffolds[name] = self._encode_scaffold(layout, name, encoded.kv)
        self.schemas[schema.name] = encoded
        logger.info("encoded schema %r: %d spans, %d bytes", schema.name, len(encoded.kv), encoded.nbytes)
        return encoded

    def _encode_isolated(self, layout: SchemaLayout) -> dict[str, SpanKV]:
        spans = list(layout.spans.values())
        kv: dict[str, SpanKV] = {}
        prefix = None
        if layout.prefix is not None:
            head = layout.spans[layout.prefix]
            prefix = encode_spans(self.lm.model, [(head.token_ids, head.positions)])[0]
            kv[head.name] = prefix
        rest = sorted((s for s in spans if s.name != layout.prefix and s.token_ids), key=lambda s: len(s.token_ids))
        for i in range(0, len(rest), _ENCODE_BATCH):
            batch = rest[i : i + _ENCODE_BATCH]
            encoded = encode_spans(self.lm.model, [(s.token_ids, s.positions) for s in batch], prefix)
            kv.update({s.name: e for s, e in zip(batch, encoded, strict=True)})
        for span in spans:  # modules that are only params or nested modules have no tokens of their own
            kv.setdefault(span.name, _empty_kv(self.lm, self.kv_dtype))
        return {name: value.to(self.kv_device, self.kv_dtype) for name, value in kv.items()}

    def _encode_scaffold(self, layout: SchemaLayout, scaffold: str, isolated: dict[str, SpanKV]) -> dict[str, SpanKV]:
        members = [layout.spans[n] for n in layout.scaffold_members(scaffold)]
        ids = [t for m in members for t in m.token_ids]
        positions = [p for m in members for p in m.positions]
        prefix = isolated.get(layout.prefix) if layout.prefix else None
        joint = encode_spans(
            self.lm.model, [(ids, positions)], None if prefix is None else prefix.to(self.lm.device, self.lm.dtype)
        )[0]
        out, offset = {}, 0
        for m in members:
            n = len(m.token_ids)
            out[m.name] = SpanKV(
                joint.keys[:, :, offset : offset + n],
                joint.values[:, :, offset : offset + n],
                joint.positions[offset : offset + n],
            ).to(self.kv_device, self.kv_dtype)
            offset += n
        return out

    def _planned(self, prompt: Prompt | str) -> _Planned:
        if isinstance(prompt, str):
            prompt = parse_prompt(prompt)
        encoded = self.schemas.get(prompt.schema)
        if encoded is None:
            msg = f"schema {prompt.schema!r} is not registered; known: {sorted(self.schemas) or 'none'}"
            raise UnknownSchemaError(msg, name=prompt.schema)
        validate_prompt(prompt, encoded.layout.schema)
        uses_roles = any(isinstance(c, Role) for c in prompt.children) or any(
            isinstance(c, Role) for c in encoded.layout.schema.children
        )
        wrappers = self.wrappers if uses_roles else None
        plan = plan_prompt(prompt, encoded.layout, self.tokenize, wrappers, add_generation_prompt=uses_roles)
        check_length(self.lm, plan.next_position)
        imported = set(plan.spans)
        parts, keys = [], []
        for name in plan.spans:
            span = encoded.layout.spans[name]
            joint = encoded.scaffolds.get(span.scaffold) if span.scaffold else None
            use_joint = joint is not None and imported.issuperset(joint)
            parts.append(joint[name] if use_joint else encoded.kv[name])
            keys.append(encoded.share_key(name, use_joint))
        return _Planned(encoded.layout, plan, parts, keys)

    def plan(self, prompt: Prompt | str) -> ServePlan:
        """Validate and plan ``prompt`` without running the model."""
        return self._planned(prompt).plan

    def full_prompt_ids(self, prompt: Prompt | str) -> list[int]:
        """The plain token sequence equivalent to ``prompt``: spans and computed tokens in position order."""
        return _prompt_ids(self._planned(prompt))

    def generate(
        self, prompt: Prompt | str, params: SamplingParams | None = None, **kwargs: object
    ) -> GenerationResult:
        """Serve ``prompt`` from cached modules and return the reply with timings."""
        return collect(self._serve(prompt, params, **kwargs))

    def stream(self, prompt: Prompt | str, params: SamplingParams | None = None, **kwargs: object) -> ReplyStream:
        """Stream the reply: iterate for text deltas; ``.result`` holds the ``GenerationResult`` afterwards."""
        return ReplyStream(self._serve(prompt, params, **kwargs))

    def request(self, prompt: Prompt | str, params: SamplingParams | None = None, **kwargs: object) -> Request:
        """``prompt`` as a serving ``Request`` (for ``serving.execute`` or a ``Scheduler``); kwargs are
        ``SamplingParams`` fields. Its clock starts now."""
        params = replace(params or SamplingParams(), **kwargs)  # type: ignore[arg-type]
        watch = Stopwatch()
        planned = self._planned(prompt)
        plan = planned.plan
        parts = [Part(kv, share=key) for kv, key in zip(planned.parts, planned.share_keys, strict=True)]
        context = _prompt_ids(planned)
        return Request(
            parts, plan.new_ids, plan.new_positions, plan.next_position, params, watch=watch, context_ids=context
        )

    def serve(self, request: Request) -> ReplyStream:
        """Serve a ``Request`` of this engine alone (``serving.execute``); a ``Scheduler`` batches them instead."""
        return ReplyStream(execute(self.lm, self._buffers, request, self._stop_ids))

    def _serve(
        self, prompt: Prompt | str, params: SamplingParams | None, **kwargs: object
    ) -> Iterator[str | GenerationResult]:
        yield from execute(self.lm, self._buffers, self.request(prompt, params, **kwargs), self._stop_ids)

    def generate_full(
        self, prompt: Prompt | str, params: SamplingParams | None = None, **kwargs: object
    ) -> GenerationResult:
        """Baseline: full prefill of the same tokens (contiguous positions), then the same decoding."""
        return collect(self._serve_ids(self.full_prompt_ids(prompt), params, **kwargs))

    def stream_ids(self, ids: list[int], params: SamplingParams | None = None, **kwargs: object) -> ReplyStream:
        """Full prefill of plain token ids (no cache reuse), then decoding; streams like ``stream``."""
        return ReplyStream(self._serve_ids(ids, params, **kwargs))

    def generate_ids(self, ids: list[int], params: SamplingParams | None = None, **kwargs: object) -> GenerationResult:
        """Full prefill of plain token ids, then decoding."""
        return collect(self._serve_ids(ids, params, **kwargs))

    def _serve_ids(
        self, ids: list[int], params: SamplingParams | None, **kwargs: object
    ) -> Iterator[str | GenerationResult]:
        params = replace(params or SamplingParams(), **kwargs)  # type: ignore[arg-type]
        return serve_full(self.lm, self._buffers, ids, params, self._stop_ids)


def _empty_kv(lm: LoadedModel, dtype: torch.dtype) -> SpanKV:
    layers, heads, head_dim = kv_shape(lm.model)
    empty = torch.empty(layers, heads, 0, head_dim, dtype=dtype)
    return SpanKV(empty, empty.clone(), torch.empty(0, dtype=torch.long))


def _prompt_ids(planned: _Planned) -> list[int]:
    """The plain token sequence of a planned prompt: spans and computed tokens in position order."""
    spans = [planned.layout.spans[n] for n in planned.plan.spans]
    tokens = [(p, i) for span in spans for i, p in zip(span.token_ids, span.positions, strict=True)]
    tokens += list(zip(planned.plan.new_positions, planned.plan.new_ids, strict=True))
    return [i for _, i in sorted(tokens, key=lambda t: t[0])]
