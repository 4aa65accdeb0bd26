"""A retrieved chunk as the RAG engine serves it: its text, tokens and KV at its canonical positions."""

from __future__ import annotations

from dataclasses import dataclass

from pc_rag.errors import PCRagError
from pc_rag.kv import SpanKV


@dataclass(frozen=True)
class Chunk:
    """A chunk's text, tokens and KV at its canonical positions; ``conditioned`` if encoded after the preamble.

    ``encoder`` is the ``encoding_digest`` of the splice adapter whose encoding side made the KV, or empty for the
    plain model: a mode reads only chunks encoded the way it expects.

    ``source`` names this KV (a store's chunk at one version) so that concurrent requests placing the chunk at the
    same positions share one copy; chunks without one (encoded for a single request) are never shared.
    """

    text: str
    token_ids: tuple[int, ...]
    kv: SpanKV
    conditioned: bool
    source: str | None = None
    encoder: str = ""

    def __post_init__(self) -> None:
        if self.kv.length != len(self.token_ids):
            msg = f"a chunk's KV holds {self.kv.length} tokens but it has {len(self.token_ids)} token ids"
            raise PCRagError(msg)
