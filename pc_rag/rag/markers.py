"""Module references inside prompt text: how a framework prompt tells the LLM which cached chunks to splice.

A retriever formats each retrieved chunk as ``<pc-rag-module store="…" chunk="…"/>``;
the prompt template puts them where documents go. ``split_module_prompt`` finds
them again: free text before the first reference, the referenced chunks in order,
free text after the last. Text between two references must be whitespace: every
chunk is its own span, so there is nowhere else for it to go. This module knows
nothing about KV, stores or frameworks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import pairwise

from pc_rag.errors import PCRagError

_REF = re.compile(r'<pc-rag-module store="([0-9a-f]+)" chunk="(\d+)"\s*/>')


def module_ref(store_id: str, chunk_id: int) -> str:
    """The reference a prompt carries for chunk ``chunk_id`` of store ``store_id``."""
    return f'<pc-rag-module store="{store_id}" chunk="{chunk_id}"/>'


@dataclass(frozen=True)
class ModulePrompt:
    """A prompt cut at its module references: ``before`` + chunks ``refs`` (store id, chunk id) + ``after``."""

    before: str
    refs: tuple[tuple[str, int], ...]
    after: str


def split_module_prompt(text: str) -> ModulePrompt:
    """Cut ``text`` at its references (none: all of it is ``before``); raise if text sits between two of them."""
    matches = list(_REF.finditer(text))
    if not matches:
        return ModulePrompt(text, (), "")
    for previous, following in pairwise(matches):
        between = text[previous.end() : following.start()]
        if between.strip():
            msg = (
                f"text {between.strip()[:40]!r} sits between module references at offset {previous.end()}; "
                "references must be adjacent (only whitespace between them): format retrieved chunks together"
            )
            raise PCRagError(msg)
    refs = tuple((m.group(1), int(m.group(2))) for m in matches)
    return ModulePrompt(text[: matches[0].start()], refs, text[matches[-1].end() :])
