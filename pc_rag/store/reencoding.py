"""Re-encoding a store's chunk KV from its text, for a mode: after the model's splice adapter changed (its encoding
side makes chunk KV), or to serve a mode that reads chunks otherwise (after the preamble or alone).

The new KV goes where a store keeps it, unlisted until the owner commits: new shards that replace the whole shard
table (``KVStore.replace_all``), or modules under the new encoding's keys in the module store (content-addressed:
the old ones stay for stores still reading them). This module changes the store in memory and hands the owner an
undo for a failed commit; it knows nothing about locks or commits.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

from pc_rag.kv import SpanKV
from pc_rag.rag.chunk import encoded_by
from pc_rag.rag.modes import resolve_mode
from pc_rag.store.chunk_encoding import module_text
from pc_rag.store.chunk_kv import module_encoding
from pc_rag.store.identity import encoding_mode, serving_assumptions
from pc_rag.store.module_kv import ModuleKV

if TYPE_CHECKING:
    from pc_rag.store.document_store import DocumentStore

BATCH = 64  # chunks encoded, and held in memory, at a time (one shard each)


@dataclass(frozen=True)
class ReencodeReport:
    """What ``DocumentStore.reencode`` did: chunks (and their tokens) encoded again, for which mode and encoding,
    in how many seconds; ``reused`` chunks already had a module of that encoding in the module store."""

    mode: str
    encoding_mode: str  # "<mode>/conditioned" or "<mode>/isolated"
    chunk_encoder: str  # the splice adapter encoding side's digest, or "" for the plain model
    chunks: int
    tokens: int
    seconds: float
    reused: int = 0

    def __str__(self) -> str:
        by = encoded_by(self.chunk_encoder)
        how = self.encoding_mode.split("/")[-1]
        reused = f", {self.reused} found already encoded in the module store" if self.reused else ""
        return (f"re-encoded {self.chunks} chunks ({self.tokens:,} tokens) for mode {self.mode} ({how}, by {by}) "
                f"in {self.seconds:.1f} s{reused}")  # fmt: skip


def reencode_chunks(
    store: DocumentStore, mode: str, *, progress: bool = True
) -> tuple[ReencodeReport, Callable[[], None]]:
    """Write every chunk's KV encoded from its text as ``mode`` wants it, and make ``mode`` (its identity, chunk
    encoder and serving assumptions) the store's in memory; return what was done and the undo of it all, for the
    owner to run if its commit fails. On failure here, the store is as it was."""
    began = time.perf_counter()
    stored = store.manifest.identity
    assert stored is not None
    recorded = encoding_mode(mode)  # StoreError for an unknown mode, before anything is encoded
    encoder = store.engine.chunk_encoder(mode)
    identity = replace(stored, encoding_mode=recorded, chunk_encoder=encoder)
    serving = serving_assumptions(store.engine, mode)
    chunks = store.manifest.chunks
    ids = sorted(chunks, key=lambda c: (chunks[c].n_tokens, c))  # similar lengths batch with little padding
    conditioned = resolve_mode(mode).conditioned

    def encode(chunk_ids: Sequence[int]) -> dict[int, SpanKV]:
        texts = [module_text(chunks[c].text) for c in chunk_ids]
        token_ids = [store.engine.tokenize(t) for t in texts]
        encoded = store.engine.encode_token_ids(token_ids, conditioned, texts, encoder=encoder)
        return {c: chunk.kv for c, chunk in zip(chunk_ids, encoded, strict=True)}

    kv, reused = store.kv, 0
    if isinstance(kv, ModuleKV):
        encoding, old_encoding = module_encoding(identity, kv.dtype), kv.encoding
        writer = kv.writer_for(encoding)
        by_content = {chunks[c].content_hash: c for c in ids}  # one module per content
        missing = set(writer.missing(list(by_content)))
        todo = [c for h, c in by_content.items() if h in missing]
        reused = len(ids) - len(todo)
        for start in tqdm(range(0, len(todo), BATCH), desc="re-encode", unit="batch", disable=not progress):
            spans = encode(todo[start : start + BATCH])
            writer.put_many({chunks[c].content_hash: span for c, span in spans.items()})
        kv.use_encoding(encoding)

        def undo() -> None:
            kv.use_encoding(old_encoding)  # the modules written stay: content-addressed, valid for this encoding
    else:
        shards = dict(store.manifest.shards)
        kv.replace_all(ids, encode, progress=progress, chunks_per_shard=BATCH)
        written = set(store.manifest.shards) - set(shards)
        shard_kv = kv

        def undo() -> None:
            store.manifest.shards.clear()
            store.manifest.shards.update(shards)
            shard_kv.reload(store.manifest)
            for name in written:
                (store.directory / name).unlink(missing_ok=True)

    store.manifest.identity, store.manifest.serving, store.mode = identity, serving, mode
    tokens = sum(chunks[c].n_tokens for c in ids)
    seconds = time.perf_counter() - began
    return ReencodeReport(mode, identity.encoding_mode, encoder, len(ids), tokens, seconds, reused), undo
