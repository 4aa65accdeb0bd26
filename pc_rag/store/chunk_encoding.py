"""How a store turns new chunks into KV and vectors: here, in length-sorted batches, or by ``ChunkWorkers``
(a pool of processes, e.g. Ray actors, that write modules to the store's module store and return vectors).

Chunks whose module the module store already holds (by content hash: an interrupted run, another store
built the same way) are not encoded again. This module knows nothing about where workers run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
from tqdm.auto import tqdm

from pc_rag.errors import StoreError
from pc_rag.kv import SpanKV
from pc_rag.rag.modes import resolve_mode
from pc_rag.store.manifest import ChunkRecord
from pc_rag.store.module_kv import ModuleKV

if TYPE_CHECKING:
    from pc_rag.store.document_store import DocumentStore

BATCH = 32


@dataclass(frozen=True)
class NewChunk:
    """A chunk to index: its id, token ids, text (as recorded), content hash, and whether to encode it."""

    chunk_id: int
    token_ids: tuple[int, ...]
    text: str
    content_hash: str
    encode: bool


class ChunkWorkers(Protocol):
    """Encodes the chunks marked ``encode`` into the store's module store and embeds every chunk."""

    def run(self, chunks: Sequence[NewChunk]) -> dict[int, np.ndarray]:
        """Chunk id -> its embedding, for every chunk given (once each)."""
        ...


def module_text(chunk: str) -> str:
    """The text a chunk is encoded as: the chunk, then a blank line separating it from the next one."""
    return chunk.strip() + "\n\n"


def encode_and_index(
    store: DocumentStore, records: dict[int, ChunkRecord], token_ids: dict[int, list[int]], bar: tqdm,
    workers: ChunkWorkers | None = None,
) -> None:  # fmt: skip
    """Write the KV of ``records`` to ``store.kv`` and their vectors to ``store.index``."""
    items = sorted(records.items(), key=lambda kv: kv[1].n_tokens)  # similar lengths batch with little padding
    modules = store.kv if isinstance(store.kv, ModuleKV) else None
    missing = set(modules.missing(list({r.content_hash: None for _, r in items}))) if modules else set()
    if workers is not None:
        if modules is None:
            msg = "indexing with workers needs a store whose KV lives in a module store the workers can reach"
            raise StoreError(msg)
        chunks = [NewChunk(c, tuple(token_ids[c]), r.text, r.content_hash, r.content_hash in missing) for c, r in items]
        vectors = workers.run(chunks)
        if sorted(vectors) != sorted(records):
            lost, extra = sorted(set(records) - set(vectors)), sorted(set(vectors) - set(records))
            raise StoreError(f"the workers returned no vector for chunks {lost[:5]} and unasked ones {extra[:5]}")
        store.index.add([c for c, _ in items], np.stack([vectors[c] for c, _ in items]))
        bar.update(len(items))
        return
    conditioned, encoder = resolve_mode(store.mode).conditioned, store_encoder(store)
    for i in range(0, len(items), BATCH):
        part = items[i : i + BATCH]
        todo = [(cid, r) for cid, r in part if modules is None or r.content_hash in missing]
        texts = [module_text(r.text) for _, r in todo]
        ids = [token_ids[c] for c, _ in todo]
        encoded = store.engine.encode_token_ids(ids, conditioned, texts, encoder=encoder) if todo else []
        if modules is not None:
            modules.put_many({r.content_hash: chunk.kv for (_, r), chunk in zip(todo, encoded, strict=True)})
        else:
            store.kv.put_many({cid: chunk.kv for (cid, _), chunk in zip(todo, encoded, strict=True)})
        store.index.add([cid for cid, _ in part], store.embedder.embed_documents([r.text for _, r in part]))
        bar.update(len(part))


def encode_again(store: DocumentStore, chunk_ids: Sequence[int]) -> list[SpanKV]:
    """The KV of stored ``chunk_ids`` encoded from their text, as indexing did (when their modules are lost)."""
    texts = [module_text(store.manifest.chunks[c].text) for c in chunk_ids]
    conditioned = resolve_mode(store.mode).conditioned
    ids = [store.engine.tokenize(t) for t in texts]
    return [chunk.kv for chunk in store.engine.encode_token_ids(ids, conditioned, texts, encoder=store_encoder(store))]


def store_encoder(store: DocumentStore) -> str:
    """The chunk encoder ``store``'s KV was made with (its identity's): new KV must be made the same way, or
    ``ChunkEncodingError`` (the engine's adapter changed since: ``pc-rag store reencode``)."""
    assert store.manifest.identity is not None
    return store.manifest.identity.chunk_encoder
