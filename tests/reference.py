"""The reference semantics of cached serving: one full forward with an explicit attention mask.

The sequence is laid out in cache order (spliced spans, then computed tokens) at
the plan's position ids. A span token sees what it was encoded with: the
schema's leading anonymous span and earlier tokens of its own span (or of its
scaffold, when the scaffold's joint encoding is used). A computed token sees
every cached token and the computed tokens before it. Sliding-window layers
also drop keys farther than the window, measured in the index frame in which
the key was attended (encoding frame for spans, cache frame for computed tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pc_rag.engine import PromptCache
from pc_rag.pml.nodes import Import, Module, Param, Prompt, Scaffold, Schema, Text, Union


def reference_greedy(pc: PromptCache, prompt: Prompt, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """``n`` greedy tokens and the logits [V] each was picked from, one masked full forward per token."""
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    for _ in range(n):
        logits.append(reference_last_logits(pc, prompt, tokens))
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def reference_last_logits(pc: PromptCache, prompt: Prompt, generated: list[int] = ()) -> torch.Tensor:  # type: ignore[assignment]
    """Last-position logits [V] of the full masked forward equivalent to serving ``prompt`` (then feeding the
    ``generated`` tokens, at the positions after the prompt, each seeing everything before it), laid out by
    the engine's own plan and layout."""
    plan = pc.plan(prompt)
    layout = pc.schemas[prompt.schema].layout
    imported = set(plan.spans)
    cached: list[CachedToken] = []
    for name in plan.spans:
        span = layout.spans[name]
        members = layout.scaffold_members(span.scaffold) if span.scaffold else ()
        group = span.scaffold if members and imported.issuperset(members) else name
        cached += [CachedToken(t, p, group) for t, p in zip(span.token_ids, span.positions, strict=True)]
    new_ids = [*plan.new_ids, *generated]
    new_positions = [*plan.new_positions, *range(plan.next_position, plan.next_position + len(generated))]
    return masked_forward(pc.lm.model, cached, layout.prefix, new_ids, new_positions)


@dataclass(frozen=True)
class CachedToken:
    """A token served from cache: its id, position and the group it was encoded with."""

    token: int
    position: int
    group: str


def masked_forward(
    model: torch.nn.Module, cached: list[CachedToken], prefix: str | None, new_ids: list[int], new_positions: list[int]
) -> torch.Tensor:
    """Last logits [V] of one forward over ``cached`` then new tokens: a cached token sees the ``prefix`` group
    and the tokens of its own group before it; a new token sees every cached token and the new ones before it.
    Sliding windows count distance in the frame each key was attended in (encoding frame for cached tokens)."""
    prefix_len = sum(c.group == prefix for c in cached) if prefix else 0
    group_len: dict[str, int] = {}
    frame: list[int] = []  # index of each token in the frame it was encoded in
    for c in cached:
        frame.append((0 if c.group == prefix else prefix_len) + group_len.get(c.group, 0))
        group_len[c.group] = group_len.get(c.group, 0) + 1
    ids = [c.token for c in cached] + list(new_ids)
    positions = [c.position for c in cached] + list(new_positions)
    n, k = len(ids), len(cached)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    distance = torch.zeros(n, n, dtype=torch.long)
    for i in range(n):
        for j in range(i + 1):
            if i >= k:
                allowed[i, j] = True
                distance[i, j] = i - j
            elif cached[j].group == cached[i].group or (prefix is not None and cached[j].group == prefix):
                allowed[i, j] = True
                distance[i, j] = frame[i] - frame[j]
    config = model.config.get_text_config()
    full = _additive(allowed)
    mask: object = full
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        mask = {"full_attention": full, "sliding_attention": _additive(allowed & (distance < config.sliding_window))}
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions]), attention_mask=mask, use_cache=False
        )
    return out.logits[0, -1].float()


def independent_sequence(
    schema: Schema, prompt: Prompt, tokenize: Callable[[str], list[int]], bos: list[int]
) -> tuple[list[CachedToken], str | None, list[int], list[int]]:
    """The cached tokens, prefix group, new ids and new positions of serving ``prompt``, derived from the
    schema by a second, simple implementation of the PML rules (no roles; text only after the last import).

    Schema text is tokenized node by node, positions run in document order from 0 (after ``bos``, which opens
    the leading anonymous text), union members share a start and the union is as long as its longest member,
    a param reserves its length, a nested module's tokens sit inside its parent's range. Arguments fill their
    param's first positions; trailing prompt text starts past every included span.
    """
    spans: dict[str, dict] = {}  # name -> ids, positions, end, scaffold, params
    pos = len(bos)
    anonymous: list[dict] = [{"ids": list(bos), "positions": list(range(len(bos))), "start": 0}]

    def module(node: Module, scaffold: str | None) -> None:
        nonlocal pos
        own = {"ids": [], "positions": [], "scaffold": scaffold, "params": {}, "start": pos}
        spans[node.name] = own
        for child in node.children:
            if isinstance(child, Text):
                ids = tokenize(child.text)
                own["ids"] += ids
                own["positions"] += range(pos, pos + len(ids))
                pos += len(ids)
            elif isinstance(child, Param):
                own["params"][child.name] = pos
                pos += child.length
            else:
                structural(child, None)
        own["end"] = pos

    def structural(node: object, scaffold: str | None) -> None:
        nonlocal pos
        if isinstance(node, Module):
            module(node, scaffold)
        elif isinstance(node, Union):
            start = end = pos
            for member in node.members:
                pos = start
                module(member, None)
                end = max(end, pos)
            pos = end
        elif isinstance(node, Scaffold):
            for member in node.modules:
                module(member, node.name)
        else:
            raise AssertionError(f"the independent reference does not handle {node!r}")

    open_run = True
    for node in schema.children:
        if isinstance(node, Text):
            if not open_run:
                anonymous.append({"ids": [], "positions": [], "start": pos})
                open_run = True
            ids = tokenize(node.text)
            anonymous[-1]["ids"] += ids
            anonymous[-1]["positions"] += range(pos, pos + len(ids))
            pos += len(ids)
        else:
            open_run = False
            structural(node, None)
    for i, run in enumerate(a for a in anonymous if a["ids"]):
        spans[f"#anon{i}"] = {**run, "scaffold": None, "params": {}, "end": run["start"] + len(run["ids"])}
    prefix = "#anon0" if anonymous[0]["ids"] and anonymous[0]["start"] == 0 else None

    imported: list[Import] = []
    trailing: list[str] = []

    def collect(nodes: tuple) -> None:
        for node in nodes:
            if isinstance(node, Import):
                assert not trailing, "the independent reference handles text only after the last import"
                imported.append(node)
                collect(node.children)
            else:
                trailing.append(node.text)

    collect(prompt.children)
    names = {i.name for i in imported}
    included = sorted((n for n in spans if n.startswith("#anon") or n in names), key=lambda n: spans[n]["start"])
    scaffolds: dict[str, set[str]] = {}
    for name, span in spans.items():
        if span["scaffold"]:
            scaffolds.setdefault(span["scaffold"], set()).add(name)
    cached = []
    for name in included:
        span = spans[name]
        joint = span["scaffold"] and scaffolds[span["scaffold"]] <= names
        group = span["scaffold"] if joint else name
        cached += [CachedToken(t, p, group) for t, p in zip(span["ids"], span["positions"], strict=True)]
    new_ids: list[int] = []
    new_positions: list[int] = []
    for node in imported:
        for param, value in node.args:
            ids = tokenize(value)
            start = spans[node.name]["params"][param]
            new_ids += ids
            new_positions += range(start, start + len(ids))
    after = max(spans[n]["end"] for n in included)
    for text in trailing:
        ids = tokenize(text)
        new_ids += ids
        new_positions += range(after, after + len(ids))
        after += len(ids)
    return cached, prefix, new_ids, new_positions


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=torch.float32)
    mask[~allowed] = torch.finfo(torch.float32).min
    return mask[None, None]


def recompute_oracle_logits(
    model: torch.nn.Module,
    head: list[int],
    chunks: list[list[int]],
    selected: list[int],
    tail: list[int],
    generated: list[int] = (),  # type: ignore[assignment]
) -> torch.Tensor:
    """Logits [V] after ``tail`` and ``generated`` of serving separately encoded ``chunks`` with the chunk
    tokens at cache indices ``selected`` recomputed: one masked full forward, built from first principles.

    The sequence holds every chunk token as encoded alone (seeing only its own chunk), then fresh copies of
    the selected tokens at the same positions, seeing the head, the unselected chunk tokens before them and
    the fresh selected ones before them; the tail and generated tokens see the head, unselected tokens as
    encoded alone, selected tokens fresh, and each other causally. No code of the engine is used.
    """
    cache_ids = [*head, *(t for chunk in chunks for t in chunk)]
    owner = [-1] * len(head) + [c for c, chunk in enumerate(chunks) for _ in chunk]
    chosen = set(selected)
    after = [*tail, *generated]
    ids = cache_ids + [cache_ids[i] for i in selected] + after
    positions = list(range(len(cache_ids))) + list(selected) + list(range(len(cache_ids), len(cache_ids) + len(after)))
    n, cached, fresh = len(ids), len(cache_ids), len(cache_ids) + len(selected)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for i in range(cached):  # the head, and chunk tokens as encoded alone
        for j in range(i + 1):
            allowed[i, j] = owner[i] == owner[j]
    visible_stale = [j for j in range(cached) if j not in chosen]
    for row, i in enumerate(selected):  # a fresh copy of cache index i
        allowed[cached + row, [j for j in visible_stale if j < i]] = True
        allowed[cached + row, [cached + r for r, k in enumerate(selected) if k <= i]] = True
    for row in range(fresh, n):
        allowed[row, visible_stale] = True
        allowed[row, cached:fresh] = True
        allowed[row, fresh : row + 1] = True
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.tensor([positions]),
            attention_mask=_additive(allowed),
            use_cache=False,
        )
    return out.logits[0, -1].float()
