"""A retrieved chunk as the RAG engine serves it: its text, tokens and KV at its canonical positions; and what is
said when chunks were encoded otherwise than a mode reads them."""

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


class ChunkEncodingError(PCRagError):
    """Chunks encoded otherwise than a mode reads them (by another splice adapter's encoding side, or by none)."""


def encoded_by(encoder: str) -> str:
    """Who made chunk KV, for messages: a splice adapter's encoding side (its digest), or the plain model."""
    return f"splice adapter encoding {encoder}" if encoder else "the plain model"


def reencode_command(store: str = "STORE", mode: str | None = None) -> str:
    """The command that re-encodes ``store`` (a quoted directory, or a placeholder) for ``mode``."""
    return f"pc-rag store reencode --store {store}" + (f" --mode {mode}" if mode else "")


def mode_mismatch(what: str, have: str, wanted: str, mode: str, store: str = "STORE") -> str:
    """One line: ``what`` (chunks) encoded by ``have`` cannot be read by ``mode``, which wants ``wanted``."""
    return (
        f"{what} encoded by {encoded_by(have)}, but mode {mode!r} reads chunks encoded by {encoded_by(wanted)}: "
        f"re-encode them with `{reencode_command(store, mode)}`"
    )


def encoder_mismatch(have: str, now: str, store: str = "STORE") -> str:
    """One line: chunks encoded by ``have`` cannot be added to, because the model's adapter now encodes ``now``."""
    now_text = now or "nothing (it has no encoding side)"
    return (
        f"chunks are encoded by {encoded_by(have)} here, but this model's adapter encodes {now_text}: new chunks "
        f"would not match; re-encode the store with `{reencode_command(store)}` first"
    )
