"""Module references inside prompt text: how a framework prompt tells the LLM which cached chunks to splice.

A retriever formats each retrieved chunk as ``<pc-rag-module store="…" chunk="…" sig="…"/>``;
the prompt template puts them where documents go. ``split_module_prompt`` finds
them again: free text before the first reference, the referenced chunks in order,
free text after the last. Text between two references must be whitespace: every
chunk is its own span, so there is nowhere else for it to go.

The signature is an HMAC under a secret of this process, so only references our own
retrievers made splice anything: a question or a document that contains reference-like
text (forged, copied from another process, or unsigned) cannot pull chunks into the
prompt; it is plain text. This module knows nothing about KV, stores or frameworks.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass
from itertools import pairwise

from pc_rag.errors import PCRagError

_REF = re.compile(r'<pc-rag-module store="([0-9a-f]+)" chunk="(\d+)" sig="([0-9a-f]{32})"\s*/>')
_SECRET = secrets.token_bytes(32)  # per process: references verify only where they were made


def module_ref(store_id: str, chunk_id: int) -> str:
    """The (signed) reference a prompt carries for chunk ``chunk_id`` of store ``store_id``."""
    return f'<pc-rag-module store="{store_id}" chunk="{chunk_id}" sig="{_signature(store_id, chunk_id)}"/>'


def _signature(store_id: str, chunk_id: int) -> str:
    return hmac.new(_SECRET, f"{store_id}:{chunk_id}".encode(), hashlib.sha256).hexdigest()[:32]


def _genuine(match: re.Match[str]) -> bool:
    return hmac.compare_digest(match.group(3), _signature(match.group(1), int(match.group(2))))


@dataclass(frozen=True)
class ModulePrompt:
    """A prompt cut at its module references: ``before`` + chunks ``refs`` (store id, chunk id) + ``after``."""

    before: str
    refs: tuple[tuple[str, int], ...]
    after: str


def split_module_prompt(text: str) -> ModulePrompt:
    """Cut ``text`` at its genuine references (none: all of it is ``before``); raise if text sits between two.

    Reference-like text without a valid signature of this process is left as text.
    """
    matches = [m for m in _REF.finditer(text) if _genuine(m)]
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
