"""A retrieved chunk as the RAG engine serves it: its text, tokens and KV at its canonical positions."""

from __future__ import annotations

from dataclasses import dataclass

from pc_rag.kv import SpanKV


@dataclass(frozen=True)
class Chunk:
    """A chunk's text, tokens and KV at its canonical positions; ``conditioned`` if encoded after the preamble."""

    text: str
    token_ids: tuple[int, ...]
    kv: SpanKV
    conditioned: bool
