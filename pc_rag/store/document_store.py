"""A document store: one prompt module per chunk, indexed in FAISS, answered through the RAG engine.

Adding documents splits them into token chunks, encodes each chunk's KV once
(in batches, at the engine's canonical position), embeds it and indexes it.
Retrieval returns ``ModuleHandle``s, not text; answering splices the handles'
KV. On disk a store is ``manifest.json`` (the commit point, written last),
``kv/*.safetensors`` shards and ``index.faiss``. This module knows nothing
about attention or recovery: that is the engine's.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from pc_rag.errors import PCRagError, StoreError
from pc_rag.generate import GenerationResult, ReplyStream
from pc_rag.rag.engine import Chunk, RagEngine
from pc_rag.rag.markers import module_ref, split_module_prompt
from pc_rag.rag.modes import resolve_mode
from pc_rag.rag.order import BEST_FIRST, DEFAULT_ORDER, reorder
from pc_rag.store.chunking import split_text
from pc_rag.store.embeddings import Embedder, SentenceTransformerEmbedder, as_embedder
from pc_rag.store.index import VectorIndex
from pc_rag.store.kvstore import DEFAULT_LRU_BYTES, KVStore
from pc_rag.store.manifest import MANIFEST_NAME, ChunkRecord, DocRecord, Manifest, StoreIdentity, tokenizer_hash

logger = logging.getLogger(__name__)

INDEX_NAME = "index.faiss"
Document = str | tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class ModuleHandle:
    """A retrieved chunk: what the LLM splices (by ``chunk_id``) and what a user shows as a source."""

    chunk_id: int
    score: float
    n_tokens: int
    text: str
    doc_id: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """An answer, the handles it was read from, and its generation stats."""

    text: str
    sources: tuple[ModuleHandle, ...]
    result: GenerationResult


class DocumentStore:
    """Chunks, their KV and their embeddings for one model, preamble and mode.

    ``mode`` decides how chunks are encoded (alone or after the preamble) and the
    default recovery at answer time. Use ``create`` for a new store and ``load``
    for an existing one; both check that what is on disk matches.
    """

    def __init__(
        self,
        directory: str | Path,
        engine: RagEngine,
        manifest: Manifest,
        kv: KVStore,
        index: VectorIndex,
        embedder: Embedder,
        mode: str,
    ) -> None:
        self.directory = Path(directory)
        self.engine, self.manifest, self.kv, self.index, self.embedder, self.mode = (
            engine, manifest, kv, index, embedder, mode,
        )  # fmt: skip

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
        mode: str = "default",
        storage_dtype: torch.dtype = torch.float32,
        lru_bytes: int = DEFAULT_LRU_BYTES,
    ) -> DocumentStore:
        """Start an empty store in ``directory`` (which must not hold a store yet)."""
        directory = Path(directory)
        if (directory / MANIFEST_NAME).exists():
            msg = f"{directory} already holds a store; use DocumentStore.load"
            raise StoreError(msg)
        embedder = SentenceTransformerEmbedder() if embedder is None else as_embedder(embedder)
        identity = _identity(engine, embedder, index_kind, chunk_tokens, overlap_tokens, mode, storage_dtype)
        manifest = Manifest(identity=identity, serving=_serving(engine, mode))
        directory.mkdir(parents=True, exist_ok=True)
        kv = KVStore(
            directory, dtype=storage_dtype, compute_dtype=engine.lm.dtype, lru_bytes=lru_bytes, manifest=manifest
        )
        store = cls(directory, engine, manifest, kv, VectorIndex(embedder.dim, index_kind), embedder, mode)
        store.save()
        return store

    @classmethod
    def load(
        cls,
        directory: str | Path,
        engine: RagEngine,
        *,
        embedder: object | None = None,
        lru_bytes: int = DEFAULT_LRU_BYTES,
    ) -> DocumentStore:
        """Open a store; ``StoreMismatchError`` if it was built with another model, tokenizer, preamble or embedder."""
        directory = Path(directory)
        if not (directory / MANIFEST_NAME).is_file():
            msg = f"{directory} is not a pc-rag store (no {MANIFEST_NAME})"
            raise StoreError(msg)
        manifest = Manifest.load(directory / MANIFEST_NAME)
        stored = manifest.identity
        if stored is None:
            msg = f"store manifest in {directory} has no identity"
            raise StoreError(msg)
        embedder = SentenceTransformerEmbedder() if embedder is None else as_embedder(embedder)
        mode = stored.encoding_mode.split("/")[0]
        storage = getattr(torch, stored.model_dtype.split("/")[-1])
        expected = _identity(
            engine, embedder, stored.index_kind, stored.chunk_tokens, stored.overlap_tokens, mode, storage
        )
        manifest.check_compatible(expected)
        _warn_if_serving_changed(directory, manifest.serving, _serving(engine, mode))
        kv = KVStore(directory, dtype=storage, compute_dtype=engine.lm.dtype, lru_bytes=lru_bytes, manifest=manifest)
        index = VectorIndex.load(directory / INDEX_NAME)
        store = cls(directory, engine, manifest, kv, index, embedder, mode)
        store._drop_unlisted()
        return store

    def __len__(self) -> int:
        return len(self.manifest.chunks)

    def _drop_unlisted(self) -> None:
        """After an interrupted write: forget what the manifest does not list (KV, index entries, documents
        missing a chunk) so the store is exactly its last committed contents, and free the KV on disk."""
        chunks = self.manifest.chunks
        partial = [d for d, rec in self.manifest.docs.items() if not all(c in chunks for c in rec.chunk_ids)]
        for doc_id in partial:
            for cid in self.manifest.docs.pop(doc_id).chunk_ids:
                self.manifest.chunks.pop(cid, None)
        listed = set(self.manifest.chunks)
        unindexed = self.index.remove(set(self.index.ids()) - listed)
        orphans = set(self.kv.ids()) - listed
        if not (partial or unindexed or orphans):
            return
        self.kv.delete(orphans)
        freed = self.kv.compact()
        self.save()
        logger.warning(
            "%s was interrupted while writing: dropped %d unlisted chunks' KV (%d bytes), %d index entries and %d "
            "partly stored documents", self.directory, len(orphans), freed, unindexed, len(partial),
        )  # fmt: skip

    @property
    def documents(self) -> list[str]:
        return list(self.manifest.docs)

    def add_documents(
        self, documents: Iterable[Document], ids: Sequence[str] | None = None, *, progress: bool = True
    ) -> list[str]:
        """Chunk, encode, embed and index ``documents`` (texts or ``(text, metadata)``); return their ids.

        Existing ids are replaced (``update``). Empty documents are rejected before anything is written.
        """
        docs = [(d, {}) if isinstance(d, str) else (d[0], dict(d[1])) for d in documents]
        ids = list(ids) if ids is not None else [_doc_id(text) for text, _ in docs]
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
        self.delete([doc_id for doc_id in ids if doc_id in self.manifest.docs], save=False)
        next_id = self.manifest.next_chunk_id()
        records: dict[int, ChunkRecord] = {}
        token_ids: dict[int, list[int]] = {}  # tokenized once: counted for the manifest, then encoded
        new_docs: dict[str, DocRecord] = {}
        for doc_id, text, meta, spans in pieces:
            chunk_ids = tuple(range(next_id, next_id + len(spans)))
            next_id += len(spans)
            for cid, span in zip(chunk_ids, spans, strict=True):
                token_ids[cid] = self.engine.tokenize(module_text(span.text))
                records[cid] = ChunkRecord(doc_id, span.text, len(token_ids[cid]), span.start_char, span.end_char, meta)
            new_docs[doc_id] = DocRecord(chunk_ids, hashlib.sha256(text.encode()).hexdigest(), meta)
        self._encode_and_index(records, token_ids, progress)
        # listed only now: KV writes save the manifest as they go, and an interrupted add must not list a
        # document whose chunks are not all there
        self.manifest.docs.update(new_docs)
        self.manifest.chunks.update(records)
        self.save()
        return ids

    def _encode_and_index(
        self, records: dict[int, ChunkRecord], token_ids: dict[int, list[int]], progress: bool, batch: int = 32
    ) -> None:
        conditioned = resolve_mode(self.mode).conditioned
        items = sorted(records.items(), key=lambda kv: kv[1].n_tokens)  # similar lengths batch with little padding
        bar = tqdm(total=len(items), desc="encoding chunks", unit="chunk", disable=not progress)
        for i in range(0, len(items), batch):
            part = items[i : i + batch]
            texts = [module_text(r.text) for _, r in part]
            chunks = self.engine.encode_token_ids([token_ids[cid] for cid, _ in part], conditioned, texts)
            self.kv.put_many({cid: chunk.kv for (cid, _), chunk in zip(part, chunks, strict=True)})
            self.index.add([cid for cid, _ in part], self.embedder.embed_documents([r.text for _, r in part]))
            bar.update(len(part))
        bar.close()

    def delete(self, doc_ids: Iterable[str], *, save: bool = True) -> int:
        """Remove documents and their chunks; return how many chunks were removed. Unknown ids raise."""
        doc_ids = list(doc_ids)
        unknown = [d for d in doc_ids if d not in self.manifest.docs]
        if unknown:
            msg = f"unknown document ids: {unknown[:5]}"
            raise StoreError(msg)
        chunk_ids = [c for d in doc_ids for c in self.manifest.docs.pop(d).chunk_ids]
        for cid in chunk_ids:
            self.manifest.chunks.pop(cid, None)
        self.index.remove(chunk_ids)
        self.kv.delete(chunk_ids)
        if save:
            self.save()
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
        hits = self.index.search(self.embedder.embed_query(query), k) if len(self.index) else []
        # a hit missing from the manifest was indexed by an interrupted write that never reached it
        return reorder([self.handle(cid, score) for cid, score in hits if cid in self.manifest.chunks], order)

    def chunks(self, handles: Sequence[ModuleHandle]) -> list[Chunk]:
        """The engine chunks (token ids and KV) behind ``handles``, in the given order."""
        conditioned = resolve_mode(self.mode).conditioned
        spans = self.kv.get_many([h.chunk_id for h in handles])
        out = []
        for handle, kv in zip(handles, spans, strict=True):
            text = module_text(handle.text)
            out.append(Chunk(text, tuple(self.engine.tokenize(text)), kv, conditioned))
        return out

    def answer(
        self, question: str, k: int = 5, mode: str | None = None, *, order: str = DEFAULT_ORDER, **kwargs: object
    ) -> Answer:
        """Retrieve ``k`` chunks and answer from their cached KV, laid out in ``order`` (sources too).

        ``mode`` defaults to the store's.
        """
        handles = self.search(question, k, order)
        result = self.engine.answer(self.chunks(handles), question, mode or self.mode, **kwargs)
        return Answer(result.text, tuple(handles), result)

    def answer_full(self, question: str, k: int = 5, *, order: str = DEFAULT_ORDER, **kwargs: object) -> Answer:
        """The same retrieval and layout, answered by full prefill (the baseline)."""
        handles = self.search(question, k, order)
        result = self.engine.answer_full(self.chunks(handles), question, **kwargs)
        return Answer(result.text, tuple(handles), result)

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

    def stream_prompt(
        self, prompt: str, mode: str | None = None, *, full: bool = False, **kwargs: object
    ) -> ReplyStream:
        """Serve a user-turn prompt carrying module references (or none: plain text, by full prefill).

        The text before the references replaces the preamble, the text after them is
        computed as the question. ``full=True`` serves the same tokens by full prefill.
        References to another store or to unknown chunks raise ``StoreError``.
        """
        parsed = split_module_prompt(prompt)
        foreign = sorted({store for store, _ in parsed.refs if store != self.store_id})
        if foreign:
            msg = f"the prompt references chunks of store(s) {foreign}, but this store is {self.store_id}"
            raise StoreError(msg)
        chunks = self.chunks([self.handle(cid) for _, cid in parsed.refs])
        return self.engine.stream_around(
            parsed.before, chunks, parsed.after, None if full else (mode or self.mode), **kwargs
        )

    def save(self) -> None:
        """Persist index then manifest (the manifest is the commit point; KV shards are already on disk)."""
        self.index.save(self.directory / INDEX_NAME)
        self.manifest.save(self.directory / MANIFEST_NAME)


def module_text(chunk: str) -> str:
    """The text a chunk is encoded as: the chunk, then a blank line separating it from the next one."""
    return chunk.strip() + "\n\n"


def _identity(
    engine: RagEngine, embedder: Embedder, index_kind: str, chunk_tokens: int, overlap_tokens: int, mode: str,
    storage_dtype: torch.dtype,
) -> StoreIdentity:  # fmt: skip
    try:
        conditioned = resolve_mode(mode).conditioned
    except PCRagError as e:
        raise StoreError(str(e)) from e
    encoding = "conditioned" if conditioned else "isolated"
    return StoreIdentity(
        model_name=engine.lm.name,
        model_fingerprint=engine.lm.fingerprint(),
        model_dtype=f"{str(engine.lm.dtype).removeprefix('torch.')}/{str(storage_dtype).removeprefix('torch.')}",
        tokenizer_hash=tokenizer_hash(engine.lm.tokenizer),
        chunk_tokens=chunk_tokens,
        overlap_tokens=overlap_tokens,
        preamble_hash=engine.prompt.digest(),
        encoding_mode=f"{mode}/{encoding}",
        start_position=engine.canonical_start,
        embedder_name=embedder.name,
        embedder_dim=embedder.dim,
        index_kind=index_kind,
    )


def _serving(engine: RagEngine, mode: str) -> dict[str, str]:
    """What answers in ``mode`` assume beyond the stored KV: the splice adapter's digest if the mode applies one."""
    return {"adapter": engine.tuned.adapter().digest} if resolve_mode(mode).adapter else {}


def _warn_if_serving_changed(directory: Path, recorded: dict[str, str], now: dict[str, str]) -> None:
    for key in sorted(set(recorded) | set(now)):
        if recorded.get(key) != now.get(key):
            logger.warning(
                "%s was built to answer with %s %s; this engine serves %s: its KV is still valid, but answers will "
                "differ from those the store gave before", directory, key, recorded.get(key), now.get(key),
            )  # fmt: skip


def _doc_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
