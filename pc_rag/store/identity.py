"""What a store's KV and vectors depend on, computed for an engine: its identity, dtype and serving assumptions.

``store_identity`` is what ``Manifest.check_compatible`` compares; ``serving_assumptions`` records what
answers assume beyond the KV (the splice adapter a mode applies). This module knows nothing about files.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pc_rag.errors import PCRagError, StoreCorruptedError, StoreError
from pc_rag.rag.modes import resolve_mode
from pc_rag.store.embeddings import Embedder
from pc_rag.store.kvstore import STORAGE_DTYPES
from pc_rag.store.manifest import StoreIdentity, tokenizer_hash

if TYPE_CHECKING:
    from pc_rag.rag.engine import RagEngine

logger = logging.getLogger(__name__)


def store_identity(
    engine: RagEngine, embedder: Embedder, index_kind: str, chunk_tokens: int, overlap_tokens: int, mode: str,
    storage_dtype: torch.dtype, *, chunk_encoder: str | None = None,
) -> StoreIdentity:  # fmt: skip
    """The identity of a store ``engine`` builds for ``mode``; its ``chunk_encoder`` is how ``mode`` wants chunks
    encoded (``RagEngine.chunk_encoder``) unless given (a loaded store's own: it is checked when a mode is served,
    not when the store loads)."""
    encoding = encoding_mode(mode)
    return StoreIdentity(
        model_name=engine.lm.name,
        model_fingerprint=engine.lm.fingerprint(),
        model_dtype=f"{engine.lm.compute_dtype}/{str(storage_dtype).removeprefix('torch.')}",
        tokenizer_hash=tokenizer_hash(engine.lm.tokenizer),
        chunk_tokens=chunk_tokens,
        overlap_tokens=overlap_tokens,
        preamble_hash=engine.prompt.digest(),
        encoding_mode=encoding,
        start_position=engine.canonical_start,
        embedder_name=embedder.name,
        embedder_dim=embedder.dim,
        index_kind=index_kind,
        chunk_encoder=engine.chunk_encoder(mode) if chunk_encoder is None else chunk_encoder,
    )


def encoding_mode(mode: str) -> str:
    """What a store records of ``mode``: ``<mode>/conditioned`` (chunks encoded after the preamble) or
    ``<mode>/isolated``; ``StoreError`` for an unknown mode."""
    try:
        conditioned = resolve_mode(mode).conditioned
    except PCRagError as e:
        raise StoreError(str(e)) from e
    return f"{mode}/{'conditioned' if conditioned else 'isolated'}"


def serving_assumptions(engine: RagEngine, mode: str) -> dict[str, str]:
    """What answers in ``mode`` assume beyond the stored KV: the splice adapter's digest if the mode applies one."""
    return {"adapter": engine.tuned.adapter().digest} if resolve_mode(mode).adapter else {}


def warn_if_serving_changed(directory: Path, recorded: dict[str, str], now: dict[str, str]) -> None:
    for key in sorted(set(recorded) | set(now)):
        if recorded.get(key) != now.get(key):
            logger.warning(
                "%s was built to answer with %s %s; this engine serves %s: its KV is still valid, but answers will "
                "differ from those the store gave before", directory, key, recorded.get(key), now.get(key),
            )  # fmt: skip


def storage_dtype(directory: Path, model_dtype: str) -> torch.dtype:
    """The KV storage dtype a manifest records as ``compute/storage``."""
    name = model_dtype.split("/")[-1]
    if name not in STORAGE_DTYPES:
        msg = f"store manifest in {directory} records KV storage dtype {name!r}; known: {', '.join(STORAGE_DTYPES)}"
        raise StoreCorruptedError(msg)
    return STORAGE_DTYPES[name]
