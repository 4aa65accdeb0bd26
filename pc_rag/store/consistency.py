"""Whether a store's parts agree (manifest, KV shards, vector index, files on disk), and repairing them.

``check_contents`` reads only; ``repair_contents`` changes the parts in memory (and writes compacted KV
shards) for the owner to commit. This module knows nothing about locks, commits or serving: chunks are
encoded again by the function the owner passes.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pc_rag.errors import StoreCorruptedError
from pc_rag.kv import SpanKV
from pc_rag.store.embeddings import Embedder
from pc_rag.store.files import unlisted
from pc_rag.store.index import VectorIndex
from pc_rag.store.kvstore import KVStore
from pc_rag.store.manifest import Manifest

REENCODE_BATCH = 64
Reencode = Callable[[Sequence[int]], list[SpanKV]]  # chunk ids -> their KV, encoded from the manifest's text


@dataclass(frozen=True)
class RepairReport:
    """What ``DocumentStore.repair`` changed, and what was lost: the documents dropped and their sources."""

    dropped_documents: tuple[str, ...]  # missing a chunk or its KV: add them again
    orphan_chunks: int  # KV entries of no listed chunk, deleted
    orphan_index_entries: int
    reindexed_chunks: int  # listed chunks the index lacked, embedded again
    leftover_files: int  # files of interrupted writes, removed
    freed_bytes: int
    reencoded_chunks: int = 0  # damaged or missing KV encoded again from the chunk's text
    lost_sources: tuple[str, ...] = ()  # the ``source`` of each dropped document that has one, without ``:line``

    def __str__(self) -> str:
        dropped = f" ({', '.join(self.dropped_documents[:5])}{', ...' if len(self.dropped_documents) > 5 else ''})"
        return (
            f"re-encoded {self.reencoded_chunks} damaged chunks from their text; "
            f"dropped {len(self.dropped_documents)} damaged documents{dropped if self.dropped_documents else ''}, "
            f"{self.orphan_chunks} orphan KV entries and {self.orphan_index_entries} orphan index entries; "
            f"re-indexed {self.reindexed_chunks} chunks; removed {self.leftover_files} leftover files; "
            f"freed {self.freed_bytes / 2**20:.1f} MiB"
        )

    def restore_hint(self, directory: Path) -> str | None:
        """What was lost and the command that restores it (None when nothing was)."""
        if not self.dropped_documents:
            return None
        lost = f"lost {len(self.dropped_documents)} documents: {', '.join(self.dropped_documents)}"
        if not self.lost_sources:
            return f"{lost}; add them again (DocumentStore.add_documents)"
        paths = " ".join(shlex.quote(s) for s in self.lost_sources)
        return (f"{lost}; restore them with `pc-rag index {paths} --store {shlex.quote(str(directory))}` "
                "(documents already stored unchanged are skipped)")  # fmt: skip


def check_contents(directory: Path, manifest: Manifest, kv: KVStore, index: VectorIndex, *, hint: bool = True) -> str:
    """A summary if every checksum and cross-reference is sound (with a note naming files that interrupted
    writes left, which are harmless), else ``StoreCorruptedError`` naming each problem (``hint``: and the
    command that repairs them)."""
    m = manifest
    problems = [_shard_problem(kv, name) for name in sorted(m.shards) if kv.problem(name)]
    stored, indexed, listed = set(kv.ids()), set(index.ids()), set(m.chunks)
    checks = {
        "documents missing a chunk": [d for d, r in m.docs.items() if not listed.issuperset(r.chunk_ids)],
        "chunks without KV": sorted(listed - stored),
        "chunks missing from the index": sorted(listed - indexed),
        "KV entries of no listed chunk": sorted(stored - listed),
        "index entries of no listed chunk": sorted(indexed - listed),
    }
    problems += [f"{len(found)} {what} (e.g. {found[0]})" for what, found in checks.items() if found]
    if problems:
        msg = f"the store at {directory} has problems: " + "; ".join(problems)
        msg += f"; run `pc-rag store repair --store {directory}`" if hint else ""
        raise StoreCorruptedError(msg)
    summary = (
        f"{directory}: {len(m.docs)} documents, {len(m.chunks)} chunks, {len(m.shards)} KV shards "
        f"({kv.nbytes / 2**20:.1f} MiB), commit {m.generation}: every checksum and reference is sound"
    )
    if leftovers := unlisted(directory, m.listed_files()):
        names = ", ".join(p.relative_to(directory).as_posix() for p in leftovers[:5]) + (", ..." * (len(leftovers) > 5))
        summary += (
            f"\nnote: {len(leftovers)} leftover files of interrupted writes ({names})"
            " are not part of the store and never read (or belong to a write in progress); the next commit "
            "(`pc-rag index`) or `pc-rag store compact`/`repair` removes them"
        )
    return summary


def _shard_problem(kv: KVStore, name: str) -> str:
    problem, lost, total = kv.problem(name, hint=False), kv.damaged(name), len(kv.manifest.shards[name].chunk_ids)
    return f"{problem} ({len(lost)} of its {total} chunks damaged{': ' + str(lost[:5]) if lost else ''})"


def repair_contents(
    directory: Path, manifest: Manifest, kv: KVStore, index: VectorIndex, embedder: Embedder,
    reencode: Reencode | None = None,
) -> RepairReport:  # fmt: skip
    """Encode again (``reencode``) the listed chunks whose KV is damaged or missing, or else drop their documents;
    drop documents missing a chunk, KV and index entries of no listed chunk; re-embed listed chunks the index
    lacks; compact the KV, rewriting every shard that fails its checksum (a damaged header included) from its
    chunks that match their own. The caller commits, which also removes the unlisted files counted here."""
    shards, chunks = manifest.shards, manifest.chunks
    bad = [name for name in shards if kv.problem(name) is not None]  # rewritten from their intact chunks
    damaged = {c for name in bad for c in kv.damaged(name)}
    stored = set(kv.ids())
    lost = sorted(c for c in chunks if c in damaged or c not in stored)
    if lost and reencode is not None:
        for start in range(0, len(lost), REENCODE_BATCH):  # a batch's KV in memory at a time
            batch = lost[start : start + REENCODE_BATCH]
            kv.put_many(dict(zip(batch, reencode(batch), strict=True)))  # the damaged entries are marked dead
        damaged, reencoded, lost = damaged - set(lost), len(lost), []
    else:
        reencoded = 0
    usable = set(chunks) - set(lost)
    partial = sorted(d for d, rec in manifest.docs.items() if not usable.issuperset(rec.chunk_ids))
    sources = []
    for doc_id in partial:
        record = manifest.docs.pop(doc_id)
        if isinstance(source := record.metadata.get("source"), str) and source:
            sources.append(re.sub(r":\d+$", "", source))
        for cid in record.chunk_ids:
            chunks.pop(cid, None)
    listed = set(chunks)
    unindexed = index.remove(set(index.ids()) - listed)
    orphans = kv.delete((set(kv.ids()) | damaged) - listed)
    unembedded = sorted(listed - set(index.ids()))
    if unembedded:
        index.add(unembedded, embedder.embed_documents([chunks[c].text for c in unembedded]))
    leftovers = len(unlisted(directory, manifest.listed_files()))
    freed = kv.compact(rewrite=bad) if bad else kv.compact()
    return RepairReport(tuple(partial), orphans, unindexed, len(unembedded), leftovers, freed, reencoded,
                        tuple(dict.fromkeys(sources)))  # fmt: skip
