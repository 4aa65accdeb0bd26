"""Whether a store's parts agree (manifest, KV shards, vector index, files on disk), and repairing them.

``check_contents`` reads only; ``repair_contents`` changes the parts in memory (and writes compacted KV
shards) for the owner to commit. This module knows nothing about locks, commits or serving.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pc_rag.errors import StoreCorruptedError
from pc_rag.store.embeddings import Embedder
from pc_rag.store.files import unlisted
from pc_rag.store.index import VectorIndex
from pc_rag.store.kvstore import KVStore
from pc_rag.store.manifest import Manifest


@dataclass(frozen=True)
class RepairReport:
    """What ``DocumentStore.repair`` changed."""

    dropped_documents: tuple[str, ...]  # missing a chunk or its KV: add them again
    orphan_chunks: int  # KV entries of no listed chunk, deleted
    orphan_index_entries: int
    reindexed_chunks: int  # listed chunks the index lacked, embedded again
    leftover_files: int  # files of interrupted writes, removed
    freed_bytes: int

    def __str__(self) -> str:
        dropped = f" ({', '.join(self.dropped_documents[:5])}{', ...' if len(self.dropped_documents) > 5 else ''})"
        return (
            f"dropped {len(self.dropped_documents)} damaged documents{dropped if self.dropped_documents else ''}, "
            f"{self.orphan_chunks} orphan KV entries and {self.orphan_index_entries} orphan index entries; "
            f"re-indexed {self.reindexed_chunks} chunks; removed {self.leftover_files} leftover files; "
            f"freed {self.freed_bytes / 2**20:.1f} MiB"
        )


def check_contents(directory: Path, manifest: Manifest, kv: KVStore, index: VectorIndex) -> str:
    """A summary if every shard checksum and cross-reference is sound, else ``StoreCorruptedError`` naming each
    problem."""
    m = manifest
    problems = [p for name in sorted(m.shards) if (p := kv.problem(name))]
    stored, indexed, listed = set(kv.ids()), set(index.ids()), set(m.chunks)
    checks = {
        "documents missing a chunk": [d for d, r in m.docs.items() if not listed.issuperset(r.chunk_ids)],
        "chunks without KV": sorted(listed - stored),
        "chunks missing from the index": sorted(listed - indexed),
        "KV entries of no listed chunk": sorted(stored - listed),
        "index entries of no listed chunk": sorted(indexed - listed),
        "leftover files of interrupted writes": unlisted(directory, m.listed_files()),
    }
    problems += [f"{len(found)} {what} (e.g. {found[0]})" for what, found in checks.items() if found]
    if problems:
        msg = f"the store at {directory} has problems: " + "; ".join(problems)
        raise StoreCorruptedError(msg)
    return (
        f"{directory}: {len(m.docs)} documents, {len(m.chunks)} chunks, {len(m.shards)} KV shards "
        f"({kv.nbytes / 2**20:.1f} MiB), commit {m.generation}: every checksum and reference is sound"
    )


def repair_contents(
    directory: Path, manifest: Manifest, kv: KVStore, index: VectorIndex, embedder: Embedder
) -> RepairReport:
    """Drop documents missing a chunk (or whose KV shard is missing or corrupted: re-add them), KV and index
    entries of no listed chunk; re-embed listed chunks the index lacks; compact the KV. The caller commits,
    which also removes the unlisted files counted here."""
    shards, chunks = manifest.shards, manifest.chunks
    damaged = {c for name, record in shards.items() if kv.problem(name) for c in record.chunk_ids}
    usable = set(chunks) - damaged
    partial = sorted(d for d, rec in manifest.docs.items() if not usable.issuperset(rec.chunk_ids))
    for doc_id in partial:
        for cid in manifest.docs.pop(doc_id).chunk_ids:
            chunks.pop(cid, None)
    listed = set(chunks)
    unindexed = index.remove(set(index.ids()) - listed)
    orphans = kv.delete((set(kv.ids()) | damaged) - listed)
    lost = sorted(listed - set(index.ids()))
    if lost:
        index.add(lost, embedder.embed_documents([chunks[c].text for c in lost]))
    leftovers = len(unlisted(directory, manifest.listed_files()))
    freed = kv.compact()
    return RepairReport(tuple(partial), orphans, unindexed, len(lost), leftovers, freed)
