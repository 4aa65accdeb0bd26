"""A document store: one prompt module per chunk, its KV encoded once, indexed in FAISS.

Adding documents splits them into token chunks, encodes each chunk's KV once
(in batches, at the engine's canonical position), embeds it and indexes it.
Retrieval returns ``ModuleHandle``s, not text, and ``chunks`` hands their KV to
whoever answers (``pc_rag.server.PromptServer``): the store only stores. On disk
a store is ``manifest.json`` (the commit point, written last), ``kv/*.safetensors``
shards and one index file per commit (``files``). This module knows nothing about
attention, recovery or serving.
"""

from __future__ import annotations

import hashlib
import logging
import shlex
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from pc_rag.errors import StoreCorruptedError, StoreError
from pc_rag.modules.interface import ModuleStore
from pc_rag.modules.keys import content_hash
from pc_rag.rag.chunk import Chunk, ChunkEncodingError, mode_mismatch
from pc_rag.rag.markers import module_ref, split_module_prompt
from pc_rag.rag.modes import resolve_mode
from pc_rag.rag.order import BEST_FIRST, reorder
from pc_rag.store._atomic import sha256_file
from pc_rag.store.chunk_encoding import ChunkWorkers, encode_again, encode_and_index, module_text, store_encoder
from pc_rag.store.chunk_kv import ChunkKV, open_chunk_kv
from pc_rag.store.chunking import split_text
from pc_rag.store.codec_setup import install_codec, open_codec, parse_codec
from pc_rag.store.commit_schedule import CommitSchedule
from pc_rag.store.committed import manifest_stamp, read_commit
from pc_rag.store.consistency import RepairReport, check_contents, repair_contents
from pc_rag.store.embeddings import Embedder, SentenceTransformerEmbedder, as_embedder
from pc_rag.store.files import bytes_on_disk, index_name, refuse_existing, remove_unlisted
from pc_rag.store.handles import ModuleHandle
from pc_rag.store.identity import serving_assumptions, storage_dtype, store_identity, warn_if_serving_changed
from pc_rag.store.index import VectorIndex
from pc_rag.store.kvstore import DEFAULT_LRU_BYTES
from pc_rag.store.manifest import MANIFEST_NAME, ChunkRecord, DocRecord, IndexRecord, Manifest, text_hash
from pc_rag.store.module_kv import ModuleKV
from pc_rag.store.reencoding import ReencodeReport, reencode_chunks
from pc_rag.store.writer_lock import WriterLock

if TYPE_CHECKING:  # the engine encodes for the store; importing it would load the serving stack
    from pc_rag.rag.engine import RagEngine

logger = logging.getLogger(__name__)

Document = str | tuple[str, dict[str, Any]]


class DocumentStore:
    """Chunks, their KV and their embeddings for one model, preamble and mode.

    ``mode`` decides how chunks are encoded (alone or after the preamble) and the
    default recovery at answer time. Use ``create`` for a new store and ``load``
    for an existing one; both check that what is on disk matches.

    Transactions: every write (``add_documents``, ``delete``, ``compact``,
    ``repair``, ``recode``, ``reencode``) first takes the store's writer lock, held until ``close``: one
    writer at a time, across processes, and a second gets ``StoreLockedError``.
    A change becomes visible to other processes only when ``commit`` replaces
    the manifest, so a killed writer leaves the last commit intact. Loading never
    writes and never waits for the lock; a loaded store follows later commits
    (``refresh``, run by ``search``). Thread-safe: writes are serialized,
    searches and reads of chunk KV run alongside them.
    """

    def __init__(
        self,
        directory: str | Path,
        engine: RagEngine,
        manifest: Manifest,
        kv: ChunkKV,
        index: VectorIndex,
        embedder: Embedder,
        mode: str,
    ) -> None:
        self.directory = Path(directory)
        self.engine, self.manifest, self.kv, self.index, self.embedder, self.mode = (
            engine, manifest, kv, index, embedder, mode,
        )  # fmt: skip
        self._writer = WriterLock(self.directory)
        self._write_mutex = threading.RLock()  # one write at a time in this process
        self._seen = manifest_stamp(self.directory)
        self.warned_damaged: set[int] = set()  # chunks an answer skipped as damaged, warned about (intact_chunks)

    @classmethod
    def create(
        cls,
        directory: str | Path,
        engine: RagEngine,
        *,
        embedder: object | None = None,
        index_kind: str = "flat",
        chunk_tokens: int = 256,
        overlap_tokens: int = 32,
        mode: str | None = None,
        storage_dtype: torch.dtype | None = None,
        lru_bytes: int = DEFAULT_LRU_BYTES,
        codec: str | None = None,
        modules: str | ModuleStore | None = None,
    ) -> DocumentStore:
        """Start an empty store in ``directory`` (new, or empty), holding its writer lock (KV in ``storage_dtype``,
        or compressed: ``codec`` ``cachegen[:LEVEL[,LEVEL...]]`` needs the model's CacheGen tables). With
        ``modules`` (an address such as ``redis://host:6379/0``, or a ``ModuleStore``), chunk KV is kept there,
        shared with every store built the same way, instead of in the directory. ``mode`` (default: the engine's
        ``default_mode``) is recorded: the store answers with it for good unless a caller names another."""
        directory, storage_dtype = Path(directory), storage_dtype or engine.kv_dtype  # default: the engine's
        mode = mode or engine.default_mode
        refuse_existing(directory)
        if chunk_tokens < 1 or not 0 <= overlap_tokens < chunk_tokens:
            got = f"got {chunk_tokens} and {overlap_tokens}"
            msg = f"chunk_tokens must be >= 1 and 0 <= overlap_tokens < chunk_tokens: {got}"
            raise StoreError(msg)
        embedder = SentenceTransformerEmbedder() if embedder is None else as_embedder(embedder)
        identity = store_identity(engine, embedder, index_kind, chunk_tokens, overlap_tokens, mode, storage_dtype)
        manifest = Manifest(identity=identity, serving=serving_assumptions(engine, mode))
        if modules is not None:
            manifest.modules = modules if isinstance(modules, str) else modules.url
        directory.mkdir(parents=True, exist_ok=True)
        levels = parse_codec(codec)
        kv_codec = install_codec(directory, manifest, engine.lm.fitted_fingerprints(), levels) if levels else None
        kv = open_chunk_kv(directory, manifest, storage=storage_dtype, compute_dtype=engine.lm.dtype,
                           lru_bytes=lru_bytes, codec=kv_codec, modules=modules)  # fmt: skip
        store = cls(directory, engine, manifest, kv, VectorIndex(embedder.dim, index_kind), embedder, mode)
        store._writer.acquire()
        try:
            refuse_existing(directory)  # another process may have created it between our check and the lock
        except StoreError:
            store.close()
            raise
        store.commit()
        return store

    @classmethod
    def load(
        cls,
        directory: str | Path,
        engine: RagEngine,
        *,
        embedder: object | None = None,
        lru_bytes: int = DEFAULT_LRU_BYTES,
        modules: str | ModuleStore | None = None,
        recompute_missing: bool = False,
    ) -> DocumentStore:
        """Open a store read-only (writes take the lock when they come); ``StoreMismatchError`` if it was built
        with another model, tokenizer, preamble or embedder. A store whose KV lives in a module store reads it
        there (``modules`` overrides the address it was built with); with ``recompute_missing``, a chunk whose
        module is missing or whose module store is unreachable is encoded again from its text."""
        directory = Path(directory)
        if not (directory / MANIFEST_NAME).is_file():
            msg = f"{directory} is not a pc-rag store (no {MANIFEST_NAME})"
            raise StoreError(msg)
        manifest, index = read_commit(directory)
        stored = manifest.identity
        if stored is None:
            msg = f"store manifest in {directory} has no identity"
            raise StoreError(msg)
        embedder = SentenceTransformerEmbedder() if embedder is None else as_embedder(embedder)
        mode = stored.encoding_mode.split("/")[0]
        storage = storage_dtype(directory, stored.model_dtype)
        expected = store_identity(  # how its chunks were encoded is checked when a mode is served (check_mode)
            engine, embedder, stored.index_kind, stored.chunk_tokens, stored.overlap_tokens, mode, storage,
            chunk_encoder=stored.chunk_encoder,
        )  # fmt: skip
        manifest.check_compatible(expected)
        if problem := _encoding_problem(directory, engine, stored.chunk_encoder, mode):  # other modes may read it
            logger.warning("%s (it loads, but answering in mode %r is refused until then)", problem, mode)
        else:
            warn_if_serving_changed(directory, manifest.serving, serving_assumptions(engine, mode))
        codec = open_codec(directory, manifest, engine.lm.fingerprint())
        kv = open_chunk_kv(directory, manifest, storage=storage, compute_dtype=engine.lm.dtype, lru_bytes=lru_bytes,
                           codec=codec, modules=modules)  # fmt: skip
        store = cls(directory, engine, manifest, kv, index, embedder, mode)
        if recompute_missing:
            if not isinstance(kv, ModuleKV):
                msg = f"recompute_missing: the store at {directory} keeps its KV in its own shards, not a module store"
                raise StoreError(msg)
            kv.recompute = partial(encode_again, store)
        return store

    def __len__(self) -> int:
        return len(self.manifest.chunks)

    def close(self) -> None:
        """Release the writer lock (if this object wrote) and the cached KV; uncommitted changes are not written."""
        self._writer.release()
        self.kv.close()

    def __enter__(self) -> DocumentStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def commit(self) -> None:
        """Make every change so far durable and visible to other processes.

        Writes the index as a new file, then replaces the manifest naming it (the commit point), then removes
        what the new manifest no longer lists: the previous index file, shards ``compact`` retired, and files
        an interrupted writer left behind.
        """
        with self._write_mutex:
            self._begin_write()
            generation = self.manifest.generation + 1
            name = index_name(generation)
            self.index.save(self.directory / name)
            previous = self.manifest.index, self.manifest.generation
            self.manifest.index = IndexRecord(name, sha256_file(self.directory / name))
            self.manifest.generation = generation
            try:
                self.manifest.save(self.directory / MANIFEST_NAME)
            except BaseException:
                self.manifest.index, self.manifest.generation = previous
                (self.directory / name).unlink(missing_ok=True)
                raise
            self._seen = manifest_stamp(self.directory)
            remove_unlisted(self.directory, self.manifest.listed_files())

    def refresh(self) -> bool:
        """Follow commits another process made since this store was loaded; return whether there were any.

        A writer (this object holds the lock) is always current. Called by ``search``.
        """
        if self._writer.held or manifest_stamp(self.directory) == self._seen:
            return False
        with self._write_mutex:
            stamp = manifest_stamp(self.directory)
            manifest, index = read_commit(self.directory)
            self._refuse_another_setup(manifest)
            changed = manifest.generation != self.manifest.generation
            if changed:
                self._adopt(manifest, index)
            self._seen = stamp
            return changed

    def repair(self, *, reencode: bool = True) -> RepairReport:
        """Bring the store back to a consistent state after damage or an old pc-rag's interrupted write, and
        commit (``consistency.repair_contents`` says what it drops and rebuilds). Chunks whose KV is damaged or
        missing are encoded again from their text with this store's engine (``reencode``), else their documents
        are dropped and named in the report. ``StoreCorruptedError`` naming what is left when the store still
        fails ``verify`` afterwards. A store written by this version needs none of it after a crash: see the
        class docstring."""
        with self._write_mutex:
            self._begin_write()
            again = partial(encode_again, self) if reencode else None
            report = repair_contents(self.directory, self.manifest, self.kv, self.index, self.embedder, again)
            self.commit()
        try:
            check_contents(self.directory, self.manifest, self.kv, self.index, hint=False)
        except StoreCorruptedError as e:
            msg = f"repair could not fix everything ({report}); what is left: {e}"
            raise StoreCorruptedError(msg) from e
        return report

    def verify(self) -> str:
        """Check every checksum and cross-reference without writing; a summary, or ``StoreCorruptedError``
        naming each problem (``repair`` fixes what it names)."""
        summary = check_contents(self.directory, self.manifest, self.kv, self.index)
        if isinstance(self.kv, ModuleKV) and (lost := self.kv.missing_chunks()):
            msg = (f"{len(lost)} chunks of {self.directory} have no module in {self.kv.modules.url} (e.g. chunk "
                   f"{lost[0]}): load with recompute_missing, or re-index their documents")  # fmt: skip
            raise StoreCorruptedError(msg)
        return summary

    def compact(self) -> int:
        """Rewrite KV shards without deleted chunks and commit; return the bytes freed on disk.

        Processes that loaded the store before and have not refreshed may then miss the retired shards.
        """
        with self._write_mutex:
            self._begin_write()
            before = bytes_on_disk(self.directory)
            self.kv.compact()
            self.commit()
            return before - bytes_on_disk(self.directory)

    def recode(self, codec: str, *, progress: bool = True) -> int:
        """Re-encode every chunk's raw KV as ``codec`` (``raw``, ``cachegen[:LEVEL,...]``) in new shards, committed at
        once (a crash leaves the store as it was); return the bytes on disk after."""
        with self._write_mutex:
            self._begin_write()
            levels, before = parse_codec(codec), (self.manifest.codec_tables, self.manifest.codec_levels)
            self.manifest.codec_tables, self.manifest.codec_levels = None, ()
            fingerprints = self.engine.lm.fitted_fingerprints()
            try:
                self.kv.recode(install_codec(self.directory, self.manifest, fingerprints, levels) if levels else None,
                               levels, progress=progress)  # fmt: skip
            except BaseException:
                self.manifest.codec_tables, self.manifest.codec_levels = before
                raise
            self.commit()
            return bytes_on_disk(self.directory)

    def reencode(self, mode: str | None = None, *, progress: bool = True) -> ReencodeReport:
        """Encode every chunk's KV again from its text with this engine, the way ``mode`` (default: the store's)
        reads chunks (after the preamble or alone; by the splice adapter's encoding side or the plain model), and
        make ``mode`` the store's, with its chunk encoder and serving assumptions: one commit, before which nothing
        is visible (a crash leaves the store as it was). Any mode may follow any other: the KV is made from text.
        What ``pc-rag store reencode`` runs after the model's adapter changed, or to serve another mode."""
        with self._write_mutex:
            self._begin_write()
            old_identity, old_serving, old_mode = self.manifest.identity, self.manifest.serving, self.mode
            report, undo = reencode_chunks(self, mode or self.mode, progress=progress)
            try:
                self.commit()
            except BaseException:
                self.manifest.identity, self.manifest.serving, self.mode = old_identity, old_serving, old_mode
                undo()
                raise
            return report

    def check_mode(self, mode: str | None = None) -> None:
        """``ChunkEncodingError`` unless ``mode`` (default: the store's) reads chunks encoded the way this store's
        were (``RagEngine.chunk_encoder``), naming the command that re-encodes this store for it."""
        if problem := _encoding_problem(self.directory, self.engine, store_encoder(self), mode or self.mode):
            raise ChunkEncodingError(problem)

    def _refuse_another_setup(self, manifest: Manifest) -> None:
        """``StoreError`` when the committed ``manifest`` has another identity than the one this object loaded."""
        if manifest.identity != self.manifest.identity:
            msg = f"the store at {self.directory} was re-encoded or rebuilt with another setup since it was loaded; "
            raise StoreError(msg + "load it again")

    def _begin_write(self) -> None:
        """Before the first write: take the writer lock and catch up with commits made since this store loaded."""
        if self._writer.held:
            return
        self._writer.acquire()
        try:
            if (self.directory / MANIFEST_NAME).exists():
                manifest, index = read_commit(self.directory)
                self._refuse_another_setup(manifest)
                if manifest.generation != self.manifest.generation:
                    self._adopt(manifest, index)
        except BaseException:
            self._writer.release()
            raise

    def _adopt(self, manifest: Manifest, index: VectorIndex) -> None:
        self.manifest, self.index = manifest, index
        self.kv.reload(manifest)

    @property
    def documents(self) -> list[str]:
        return list(self.manifest.docs)

    def add_documents(
        self,
        documents: Iterable[Document],
        ids: Sequence[str] | None = None,
        *,
        progress: bool = True,
        commit_every: int = 0,
        commit_seconds: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        workers: ChunkWorkers | None = None,
    ) -> list[str]:
        """Chunk, encode, embed and index ``documents`` (texts or ``(text, metadata)``); return their ids.

        An existing id is replaced (``update``), unless its text and metadata are unchanged: then it is skipped.
        A replaced document keeps its old version until the new one is committed. Empty documents are
        rejected before anything is written. With ``commit_every`` > 0, a commit follows every that many
        chunks, and with ``commit_seconds`` > 0 the first document boundary after that many seconds (of ``clock``)
        since the last commit, whichever comes first, so an interrupted run keeps its progress and a rerun
        resumes; what was added before an exception is committed before it propagates.
        ``workers`` (e.g. ``pc_rag.scaleout.RayChunkWorkers``) encode and embed in other processes, into the
        store's module store.
        """
        docs = [(d, {}) if isinstance(d, str) else (d[0], dict(d[1])) for d in documents]
        ids = list(ids) if ids is not None else [text_hash(text) for text, _ in docs]
        if len(ids) != len(docs) or len(set(ids)) != len(ids):
            msg = "document ids must be unique and one per document"
            raise StoreError(msg)
        stored = self.manifest.identity
        assert stored is not None
        pieces = []
        for doc_id, (text, meta) in zip(ids, docs, strict=True):
            spans = split_text(text, self.engine.lm.tokenizer, stored.chunk_tokens, stored.overlap_tokens)
            if not spans:
                msg = f"document {doc_id!r} is empty"
                raise StoreError(msg)
            pieces.append((doc_id, text, meta, spans))
        with self._write_mutex:
            self._begin_write()
            pieces = [p for p in pieces if not self.is_current(p[0], p[1], p[2])]
            if pieces:  # before any is encoded: the model's adapter must still encode as the store's chunks were
                self.engine.check_can_encode(store_encoder(self), shlex.quote(str(self.directory)))
            total = sum(len(p[3]) for p in pieces)
            bar = tqdm(total=total, desc="encoding chunks", unit="chunk", disable=not progress or not total)
            schedule = CommitSchedule(commit_every, commit_seconds, clock)
            try:
                for part in schedule.parts(pieces):
                    self._add_part(part, bar, workers)
                    if schedule.added(part):
                        self.commit()
                        schedule.committed()
            finally:
                bar.close()
                if schedule.pending:  # the parts added since the last commit, also when a later one failed
                    self.commit()
        return ids

    def is_current(self, doc_id: str, text: str, metadata: dict[str, Any] | None = None) -> bool:
        """Whether the store holds ``doc_id`` with exactly this text and metadata (adding it again is a no-op)."""
        record = self.manifest.docs.get(doc_id)
        return record is not None and record.sha256 == _sha256(text) and record.metadata == (metadata or {})

    def _add_part(
        self, pieces: list[tuple[str, str, dict[str, Any], list[Any]]], bar: tqdm, workers: ChunkWorkers | None
    ) -> None:
        """Encode and index ``pieces``, then swap them in for their old versions (the caller commits)."""
        fresh = iter(self.manifest.reserve_chunk_ids(sum(len(spans) for *_, spans in pieces)))
        records: dict[int, ChunkRecord] = {}
        token_ids: dict[int, list[int]] = {}  # tokenized once: counted for the manifest, then encoded
        new_docs: dict[str, DocRecord] = {}
        for doc_id, text, meta, spans in pieces:
            chunk_ids = tuple(next(fresh) for _ in spans)
            for cid, span in zip(chunk_ids, spans, strict=True):
                ids = token_ids[cid] = self.engine.tokenize(module_text(span.text))
                records[cid] = ChunkRecord(doc_id, span.text, len(ids), span.start_char, span.end_char, meta,
                                           content_hash(ids))  # fmt: skip
            new_docs[doc_id] = DocRecord(chunk_ids, _sha256(text), meta)
        try:
            encode_and_index(self, records, token_ids, bar, workers)
        except BaseException:
            self.index.remove(list(records))  # written KV stays unlisted, or listed dead: removed or compacted later
            self.kv.delete(records)
            raise
        self._forget([d for d in new_docs if d in self.manifest.docs])
        self.manifest.docs.update(new_docs)
        self.manifest.chunks.update(records)

    def delete(self, doc_ids: Iterable[str], *, save: bool = True) -> int:
        """Remove documents and their chunks; return how many chunks were removed. Unknown ids raise.

        ``save=False`` leaves the change uncommitted (``commit`` later, or ``close`` to drop it).
        """
        doc_ids = list(doc_ids)
        with self._write_mutex:
            unknown = [d for d in doc_ids if d not in self.manifest.docs]
            if unknown:
                msg = f"unknown document ids: {unknown[:5]}"
                raise StoreError(msg)
            self._begin_write()
            removed = self._forget(doc_ids)
            if save:
                self.commit()
            return removed

    def _forget(self, doc_ids: list[str]) -> int:
        """Drop documents, their chunks, index entries and KV from the store in memory; return the chunk count."""
        chunk_ids = [c for d in doc_ids for c in self.manifest.docs.pop(d).chunk_ids]
        for cid in chunk_ids:
            self.manifest.chunks.pop(cid, None)
        self.index.remove(chunk_ids)
        self.kv.delete(chunk_ids)
        return len(chunk_ids)

    def update(self, doc_id: str, text: str, metadata: dict[str, Any] | None = None) -> None:
        """Replace a document's text and metadata."""
        self.add_documents([(text, metadata or {})], [doc_id], progress=False)

    def search(self, query: str, k: int = 5, order: str = BEST_FIRST) -> list[ModuleHandle]:
        """The ``k`` chunks most similar to ``query`` as module handles (fewer if the store is smaller).

        Best first, or laid out in another chunk ``order`` (``pc_rag.rag.order``) for a prompt.
        """
        if k < 1:
            msg = f"k must be at least 1, got {k}"
            raise StoreError(msg)
        self.refresh()
        index, chunks = self.index, self.manifest.chunks
        hits = index.search(self.embedder.embed_query(query), k) if len(index) else []
        # a hit not (yet) listed belongs to a write in progress in this process
        return reorder([self.handle(cid, score) for cid, score in hits if cid in chunks], order)

    def chunks(self, handles: Sequence[ModuleHandle]) -> list[Chunk]:
        """The engine chunks (token ids and KV) behind ``handles``, in the given order, each named by its store,
        shard and level so that requests may share its KV (``Chunk.source``)."""
        conditioned, encoder = resolve_mode(self.mode).conditioned, store_encoder(self)
        spans = self.kv.get_many_versioned([h.chunk_id for h in handles])
        out = []
        for handle, (version, kv) in zip(handles, spans, strict=True):
            text = module_text(handle.text)
            source = f"store/{self.store_id}/{version}"  # the same KV wherever this store is served
            out.append(Chunk(text, tuple(self.engine.tokenize(text)), kv, conditioned, source, encoder))
        return out

    @property
    def store_id(self) -> str:
        """Names this store in module references (see ``pc_rag.rag.markers``): its resolved directory, hashed."""
        return hashlib.sha256(str(self.directory.resolve()).encode()).hexdigest()[:12]

    def module_ref(self, handle: ModuleHandle) -> str:
        """The text a prompt carries in place of ``handle``'s chunk."""
        return module_ref(self.store_id, handle.chunk_id)

    def handle(self, chunk_id: int, score: float = 0.0) -> ModuleHandle:
        """The handle of a stored chunk; ``StoreError`` if the store has no such chunk."""
        record = self.manifest.chunks.get(chunk_id)
        if record is None:
            msg = f"chunk {chunk_id} is not in the store at {self.directory} (deleted, or from another store)"
            raise StoreError(msg)
        return ModuleHandle(chunk_id, score, record.n_tokens, record.text, record.doc_id, dict(record.metadata))

    def handle_metadata(self, handle: ModuleHandle) -> dict[str, Any]:
        """The chunk's own metadata plus what names its module (store, chunk, document, token count).

        What framework retrievers attach to a retrieved chunk; the handle keys win a name clash.
        """
        return {
            **handle.metadata,
            "store_id": self.store_id,
            "chunk_id": handle.chunk_id,
            "doc_id": handle.doc_id,
            "n_tokens": handle.n_tokens,
        }

    def prompt_chunks(self, prompt: str) -> tuple[str, list[Chunk], str]:
        """A prompt carrying module references as (text before them, their chunks, text after them).

        References to another store or to unknown chunks raise ``StoreError``."""
        parsed = split_module_prompt(prompt)
        foreign = sorted({store for store, _ in parsed.refs if store != self.store_id})
        if foreign:
            msg = f"the prompt references chunks of store(s) {foreign}, but this store is {self.store_id}"
            raise StoreError(msg)
        return parsed.before, self.chunks([self.handle(cid) for _, cid in parsed.refs]), parsed.after


def _encoding_problem(directory: Path, engine: RagEngine, have: str, mode: str) -> str | None:
    """What is wrong with serving ``mode`` from chunks encoded by ``have`` (a chunk encoder), or None."""
    wanted = engine.chunk_encoder(mode)
    if wanted == have:
        return None
    what = f"the chunks of the store at {directory} were"
    return mode_mismatch(what, have, wanted, mode, shlex.quote(str(directory)))


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
