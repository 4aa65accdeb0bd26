"""A RAG query as a union-free schema prompt, laid out and planned like any PML prompt.

The preamble is the schema's leading text, every retrieved chunk a module of its own
(no union: each has its own slot), and the question uncached text after them.
``layout_schema`` and ``plan_prompt`` then assign every position, exactly as for a
Prompt Cache prompt: the chunks' slots, the question's positions and the first
generated token's. Nothing is tokenized again: each piece comes with its token ids.
This module knows nothing about KV or recovery.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pc_rag.chat import ChatWrappers
from pc_rag.errors import PCRagError
from pc_rag.layout import SchemaLayout, layout_schema
from pc_rag.plan import ServePlan, plan_prompt
from pc_rag.pml.nodes import Import, Module, Prompt, Schema, Text

SCHEMA = "rag-query"

Piece = tuple[str, Sequence[int]]  # text and its token ids


@dataclass(frozen=True)
class QueryLayout:
    """The laid-out schema of one query and its plan; ``chunks`` names the chunk spans in prompt order."""

    layout: SchemaLayout
    plan: ServePlan
    chunks: tuple[str, ...]

    @property
    def head(self) -> int:
        """Tokens of the preamble (the schema's leading text), at positions 0..head-1."""
        prefix = self.layout.prefix
        return self.layout.spans[prefix].end if prefix is not None else 0

    @property
    def chunks_end(self) -> int:
        """Cache length after the last chunk: where the question starts."""
        return self.layout.length

    def slots(self) -> list[tuple[int, int]]:
        """Each chunk's ``(start, length)`` in the cache (cache index = position: no gaps)."""
        return [(self.layout.spans[n].start, len(self.layout.spans[n].token_ids)) for n in self.chunks]

    def full_ids(self) -> list[int]:
        """The plain token sequence: every span and computed token in position order."""
        spans = self.layout.spans.values()
        tokens = [(p, i) for span in spans for i, p in zip(span.token_ids, span.positions, strict=True)]
        tokens += zip(self.plan.new_positions, self.plan.new_ids, strict=True)
        return [i for _, i in sorted(tokens)]


def layout_query(head: Piece, chunks: Sequence[Piece], question: Piece) -> QueryLayout:
    """Lay out ``head`` (cached preamble), ``chunks`` (one module each) and ``question`` (computed)."""
    names = tuple(f"chunk{i}" for i in range(len(chunks)))
    replay = _Replay([head, *chunks, question])
    schema = Schema(SCHEMA, (Text(head[0]), *(Module(n, (Text(c[0]),)) for n, c in zip(names, chunks, strict=True))))
    layout = layout_schema(schema, replay, _no_roles)
    prompt = Prompt(SCHEMA, (*(Import(n) for n in names), Text(question[0])))
    plan = plan_prompt(prompt, layout, replay, None, add_generation_prompt=False)
    replay.check_done()
    return QueryLayout(layout, plan, names)


class _Replay:
    """The tokenizer of a layout whose pieces come with their ids: returns them in the order they are asked for."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        self._pieces = deque(pieces)

    def __call__(self, text: str) -> list[int]:
        expected, ids = self._pieces.popleft()
        if text != expected:  # the layout walks the schema in document order; anything else is a bug here
            msg = f"query layout tokenized {text[:40]!r} where {expected[:40]!r} was due"
            raise PCRagError(msg)
        return list(ids)

    def check_done(self) -> None:
        if self._pieces:
            msg = f"query layout left {len(self._pieces)} pieces untokenized"
            raise PCRagError(msg)


def _no_roles() -> ChatWrappers:
    raise AssertionError("a query schema has no role nodes: its chat turns are already in the preamble's text")
