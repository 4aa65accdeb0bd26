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

import torch

from pc_rag.engine import PromptCache
from pc_rag.pml.nodes import Prompt


def reference_last_logits(pc: PromptCache, prompt: Prompt) -> torch.Tensor:
    """Last-position logits [V] of the full masked forward equivalent to serving ``prompt``."""
    plan = pc.plan(prompt)
    layout = pc.schemas[prompt.schema].layout
    imported = set(plan.spans)
    ids: list[int] = []
    positions: list[int] = []
    group: list[str] = []  # which attention group each cached token belongs to
    frame: list[int] = []  # index of each token in the frame it was encoded in
    prefix_len = len(layout.spans[layout.prefix].token_ids) if layout.prefix else 0
    group_len: dict[str, int] = {}
    for name in plan.spans:
        span = layout.spans[name]
        members = layout.scaffold_members(span.scaffold) if span.scaffold else ()
        key = span.scaffold if members and imported.issuperset(members) else name
        start = 0 if name == layout.prefix else prefix_len
        for token, position in zip(span.token_ids, span.positions, strict=True):
            ids.append(token)
            positions.append(position)
            group.append(key)
            frame.append(start + group_len.get(key, 0))
            group_len[key] = group_len.get(key, 0) + 1
    cached = len(ids)
    ids += plan.new_ids
    positions += plan.new_positions
    n = len(ids)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    distance = torch.zeros(n, n, dtype=torch.long)
    prefix = layout.prefix
    for i in range(n):
        for j in range(i + 1):
            if i >= cached:
                allowed[i, j] = True
                distance[i, j] = i - j
            elif group[j] == group[i] or (prefix is not None and group[j] == prefix):
                allowed[i, j] = True
                distance[i, j] = frame[i] - frame[j]
    model = pc.lm.model
    config = model.config.get_text_config()
    full = _additive(allowed)
    mask: object = full
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types:
        window = config.sliding_window
        mask = {"full_attention": full, "sliding_attention": _additive(allowed & (distance < window))}
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.tensor([positions]),
            attention_mask=mask,
            use_cache=False,
        )
    return out.logits[0, -1].float()


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(allowed.shape, dtype=torch.float32)
    mask[~allowed] = torch.finfo(torch.float32).min
    return mask[None, None]
