"""Turn a prompt into a serving plan: which cached spans to splice, which tokens to compute.

Imported modules (and their imported nested modules) keep the positions the
schema layout gave them; anonymous schema text is always included. Uncached
prompt text starts after the imports before it (and the anonymous text that
precedes them); text after the last import starts after every included span.
An argument fills its param's reserved positions. This module knows nothing about models or KV: it only
produces token ids and position ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from pc_rag.chat import ChatWrappers
from pc_rag.errors import ArgumentTooLongError, PMLError
from pc_rag.layout import SchemaLayout, Tokenize
from pc_rag.pml.nodes import Import, Prompt, PromptNode, Role, Text


@dataclass(frozen=True)
class ServePlan:
    """Spans to splice (in position order) and the uncached tokens to compute (in prompt order)."""

    spans: tuple[str, ...]
    new_ids: tuple[int, ...]
    new_positions: tuple[int, ...]
    next_position: int  # of the first generated token: one past every position in the prompt, cached or not


def plan_prompt(
    prompt: Prompt,
    layout: SchemaLayout,
    tokenize: Tokenize,
    wrappers: ChatWrappers | None,
    add_generation_prompt: bool,
) -> ServePlan:
    """Resolve ``prompt`` against ``layout``. The prompt must already be validated against the schema."""
    planner = _Planner(layout, tokenize, wrappers, _imports(prompt.children))
    for child in prompt.children:
        planner.node(child)
    if add_generation_prompt and wrappers is not None:
        planner.text(wrappers.generation_prompt)
    imported = planner.imported | {s.name for s in layout.spans.values() if s.anonymous}
    spans = tuple(name for name in layout.spans if name in imported)
    if not planner.ids:
        # Logits come from computed tokens: with nothing uncached there is nothing to predict from.
        msg = "a prompt needs some uncached text (e.g. a <user> turn or an argument) to answer from"
        raise PMLError(msg, name=prompt.schema)
    end = max([max(layout.spans[name].positions, default=-1) for name in spans] + list(planner.positions))
    return ServePlan(spans, tuple(planner.ids), tuple(planner.positions), next_position=end + 1)


class _Planner:
    def __init__(
        self, layout: SchemaLayout, tokenize: Tokenize, wrappers: ChatWrappers | None, imports: list[Import]
    ) -> None:
        self.layout = layout
        self.pending = len(imports)
        included = [layout.spans[name] for i in imports for name in _names(i)]
        included += [s for s in layout.spans.values() if s.anonymous]
        self.included_end = max((s.end for s in included), default=0)
        self.tokenize = tokenize
        self.wrappers = wrappers
        self.imported: set[str] = set()
        self.ids: list[int] = []
        self.positions: list[int] = []
        prefix = layout.spans[layout.prefix] if layout.prefix else None
        self.cursor = prefix.end if prefix else 0

    def node(self, node: PromptNode) -> None:
        if isinstance(node, Text):
            self.text(node.text)
        elif isinstance(node, Role):
            assert self.wrappers is not None, "roles are validated to need a chat template"
            self.text(self.wrappers.open[node.role])
            for child in node.children:
                self.node(child)  # type: ignore[arg-type]
            self.text(self.wrappers.close[node.role])
        else:
            self.use(node)

    def text(self, text: str) -> None:
        if not self.pending:
            self.cursor = max(self.cursor, self.included_end)
        ids = self.tokenize(text)
        self.ids.extend(ids)
        self.positions.extend(range(self.cursor, self.cursor + len(ids)))
        self.cursor += len(ids)

    def use(self, node: Import, top: bool = True) -> None:
        self.pending -= top
        span = self.layout.spans[node.name]
        self.imported.add(node.name)
        for param, value in node.args:
            start, length = span.params[param]
            ids = self.tokenize(value)
            if len(ids) > length:
                msg = f"argument {param!r} of module {node.name!r} is {len(ids)} tokens; its param reserves {length}"
                raise ArgumentTooLongError(msg, name=param)
            self.ids.extend(ids)
            self.positions.extend(range(start, start + len(ids)))
        for child in node.children:
            self.use(child, top=False)
        # Text after this import goes after it and after the anonymous text that precedes it in the schema.
        before = [s.end for s in self.layout.spans.values() if s.anonymous and s.start <= span.start]
        self.cursor = max([self.cursor, span.end, *before])


def _imports(nodes: tuple[PromptNode, ...]) -> list[Import]:
    """Top-level imports of a prompt in document order, including those inside roles."""
    found: list[Import] = []
    for node in nodes:
        if isinstance(node, Import):
            found.append(node)
        elif isinstance(node, Role):
            found.extend(_imports(node.children))  # type: ignore[arg-type]
    return found


def _names(node: Import) -> list[str]:
    return [node.name, *(n for child in node.children for n in _names(child))]
