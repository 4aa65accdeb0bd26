"""Assign tokens and absolute position ids to every span of a schema.

A *span* is the unit whose KV is cached: a module's own tokens (its text, not
its params or nested modules), or a run of anonymous text. Positions follow the
paper: sequential offsets in document order; union members share their start
and the union is as long as its longest member; a param reserves ``length``
positions that the module's own tokens skip. Positions are absolute, never
relative to the module. This module knows nothing about models or KV.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pc_rag.chat import ChatWrappers
from pc_rag.pml.nodes import Module, Param, Role, Scaffold, Schema, SchemaNode, Text, Union

Tokenize = Callable[[str], list[int]]


@dataclass(frozen=True)
class Span:
    """One cacheable unit. ``token_ids[i]`` sits at ``positions[i]``; ``[start, end)`` is its reserved range."""

    name: str
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    start: int
    end: int
    anonymous: bool = False
    parent: str | None = None
    union: int | None = None
    scaffold: str | None = None
    params: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (start, length)


@dataclass(frozen=True)
class SchemaLayout:
    """The spans of a schema in position order; ``prefix`` names the leading anonymous span, if any."""

    schema: Schema
    spans: dict[str, Span]
    prefix: str | None
    length: int

    def context_of(self, name: str) -> tuple[str, ...]:
        """Spans a span attends to when encoded in isolation: the leading anonymous text (paper §3.3)."""
        return () if self.prefix is None or name == self.prefix else (self.prefix,)

    def scaffold_members(self, scaffold: str) -> tuple[str, ...]:
        return tuple(s.name for s in self.spans.values() if s.scaffold == scaffold)


class _Builder:
    """Walks the schema tree once, accumulating tokens of the span being built."""

    def __init__(self, tokenize: Tokenize, wrappers: Callable[[], ChatWrappers]) -> None:
        self.tokenize = tokenize
        self.wrappers = wrappers
        self.spans: list[Span] = []
        self.pos = 0
        self.unions = 0
        self._anon: tuple[list[int], list[int], int] | None = None  # open anonymous run

    def text(self, text: str, ids: list[int], positions: list[int]) -> None:
        new = self.tokenize(text)
        ids.extend(new)
        positions.extend(range(self.pos, self.pos + len(new)))
        self.pos += len(new)

    def anonymous_text(self, text: str) -> None:
        if self._anon is None:
            self._anon = ([], [], self.pos)
        self.text(text, self._anon[0], self._anon[1])

    def close_anonymous(self) -> None:
        if self._anon is None:
            return
        ids, positions, start = self._anon
        self._anon = None
        if ids:
            name = f"#text{sum(s.anonymous for s in self.spans)}"
            self.spans.append(Span(name, tuple(ids), tuple(positions), start, self.pos, anonymous=True))

    def top(self, node: SchemaNode) -> None:
        if isinstance(node, Text):
            self.anonymous_text(node.text)
        elif isinstance(node, Role):
            wrappers = self.wrappers()
            self.anonymous_text(wrappers.open[node.role])
            for child in node.children:
                self.top(child)  # type: ignore[arg-type]
            self.anonymous_text(wrappers.close[node.role])
        else:
            self.close_anonymous()
            self.structural(node, parent=None)

    def structural(self, node: SchemaNode, parent: str | None, scaffold: str | None = None) -> None:
        if isinstance(node, Module):
            self.module(node, parent, union=None, scaffold=scaffold)
        elif isinstance(node, Union):
            start, end, union_id = self.pos, self.pos, self.unions
            self.unions += 1
            for member in node.members:
                self.pos = start
                self.module(member, parent, union=union_id, scaffold=None)
                end = max(end, self.pos)
            self.pos = end
        elif isinstance(node, Scaffold):
            for member in node.modules:
                self.module(member, parent, union=None, scaffold=node.name)
        else:
            raise AssertionError(f"unexpected node at top level: {node!r}")

    def module(self, node: Module, parent: str | None, union: int | None, scaffold: str | None) -> None:
        ids: list[int] = []
        positions: list[int] = []
        params: dict[str, tuple[int, int]] = {}
        start = self.pos
        children: list[Span] = []
        for child in node.children:
            if isinstance(child, Text):
                self.text(child.text, ids, positions)
            elif isinstance(child, Param):
                params[child.name] = (self.pos, child.length)
                self.pos += child.length
            elif isinstance(child, Role):
                wrappers = self.wrappers()
                self.text(wrappers.open[child.role], ids, positions)
                for grandchild in child.children:
                    assert isinstance(grandchild, Text), "roles inside modules hold text only"
                    self.text(grandchild.text, ids, positions)
                self.text(wrappers.close[child.role], ids, positions)
            else:
                before = len(self.spans)
                self.structural(child, parent=node.name)
                children.extend(self.spans[before:])
        span = Span(node.name, tuple(ids), tuple(positions), start, self.pos, False, parent, union, scaffold, params)
        self.spans.insert(len(self.spans) - len(children), span)


def layout_schema(
    schema: Schema, tokenize: Tokenize, wrappers: Callable[[], ChatWrappers], bos: Sequence[int] = ()
) -> SchemaLayout:
    """Tokenize ``schema`` span by span and assign absolute positions.

    ``bos`` tokens (the tokenizer's leading special tokens) open the first
    anonymous span unless the schema's first text already starts with them.
    """
    builder = _Builder(tokenize, wrappers)
    for child in schema.children:
        builder.top(child)
    builder.close_anonymous()
    spans = builder.spans
    if bos and not (
        spans and spans[0].anonymous and spans[0].start == 0 and spans[0].token_ids[: len(bos)] == tuple(bos)
    ):
        spans = [_shift(s, len(bos)) for s in spans]
        head = Span("#bos", tuple(bos), tuple(range(len(bos))), 0, len(bos), anonymous=True)
        if spans and spans[0].anonymous and spans[0].start == len(bos):
            first = spans.pop(0)
            head = Span(
                first.name,
                head.token_ids + first.token_ids,
                head.positions + first.positions,
                0,
                first.end,
                anonymous=True,
            )
        spans.insert(0, head)
    by_name = {s.name: s for s in sorted(spans, key=lambda s: s.start)}
    prefix = spans[0].name if spans and spans[0].anonymous and spans[0].start == 0 else None
    length = max((s.end for s in spans), default=0)
    return SchemaLayout(schema=schema, spans=by_name, prefix=prefix, length=length)


def _shift(span: Span, offset: int) -> Span:
    params = {k: (start + offset, n) for k, (start, n) in span.params.items()}
    return Span(
        span.name, span.token_ids, tuple(p + offset for p in span.positions), span.start + offset,
        span.end + offset, span.anonymous, span.parent, span.union, span.scaffold, params,
    )  # fmt: skip
