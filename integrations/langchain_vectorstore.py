"""LangChain ``VectorStore`` over a ``DocumentStore``: every added text is chunked and its chunks' KV cached.

Ids are the store's document ids. The store splits each text into chunks (each
one a prompt module), so a similarity search returns chunks: one ``Document``
per hit whose ``page_content`` is the chunk text, ``metadata`` its document's
metadata and ``id`` its document id (two chunks of one text share it).
``get_by_ids`` returns whole texts, rebuilt from their tiling chunks.
``as_retriever`` returns a ``PromptModuleRetriever``, whose documents also carry
the module handles a ``PromptCacheLLM`` prompt needs. This module knows nothing
about generation.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

try:
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings
    from langchain_core.vectorstores import VectorStore
except ImportError as e:  # pragma: no cover - depends on the environment
    msg = "the LangChain adapter needs langchain-core: `pip install pc-rag[langchain]`"
    raise ImportError(msg) from e

from pc_rag.errors import PCRagError, StoreError
from pc_rag.rag.engine import RagEngine
from pc_rag.retrievers.langchain import PromptModuleRetriever
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.embeddings import Embedder, LangChainEmbedder

__all__ = ["PromptCacheVectorStore"]


class PromptCacheVectorStore(VectorStore):
    """A LangChain vector store whose texts are cached as prompt modules in ``store``.

    Scores are the index's inner products (cosine similarity for the default
    normalized embeddings): higher is closer.
    """

    def __init__(self, store: DocumentStore) -> None:
        self.store = store

    @classmethod
    def from_texts(
        cls,
        texts: list[str],
        embedding: Embeddings | None,
        metadatas: list[dict] | None = None,
        *,
        ids: list[str] | None = None,
        engine: RagEngine | None = None,
        directory: str | Path | None = None,
        progress: bool = False,
        **kwargs: Any,
    ) -> PromptCacheVectorStore:
        """A new store in ``directory`` for ``engine``, holding ``texts``.

        ``embedding`` ``None`` uses the default MiniLM; ``kwargs`` are ``DocumentStore.create``
        options (``chunk_tokens``, ``overlap_tokens``, ``mode``, ``index_kind``, ``storage_dtype``).
        """
        if engine is None or directory is None:
            msg = "PromptCacheVectorStore.from_texts needs engine=RagEngine(...) and directory=<new store folder>"
            raise PCRagError(msg)
        vectorstore = cls(DocumentStore.create(directory, engine, embedder=embedding, **kwargs))
        vectorstore.add_texts(texts, metadatas, ids=ids, progress=progress)
        return vectorstore

    @property
    def embeddings(self) -> Embeddings:
        """The store's embedder as a LangChain ``Embeddings`` (the original object if it was one)."""
        embedder = self.store.embedder
        return embedder.embeddings if isinstance(embedder, LangChainEmbedder) else _EmbedderEmbeddings(embedder)

    def add_texts(
        self,
        texts: Iterable[str],
        metadatas: list[dict] | None = None,
        *,
        ids: list[str | None] | None = None,
        progress: bool = False,
        **kwargs: Any,
    ) -> list[str]:
        """Chunk, encode, embed and index ``texts``; existing ids are replaced, missing ids are random UUIDs."""
        _no_options("add_texts", kwargs)
        texts = list(texts)
        metadatas = [dict(m) for m in metadatas] if metadatas is not None else [{} for _ in texts]
        given = list(ids) if ids is not None else [None] * len(texts)
        if not len(metadatas) == len(given) == len(texts):
            msg = f"got {len(texts)} texts, {len(metadatas)} metadatas and {len(given)} ids; pass one of each per text"
            raise PCRagError(msg)
        doc_ids = [i if i is not None else str(uuid.uuid4()) for i in given]
        return self.store.add_documents(list(zip(texts, metadatas, strict=True)), doc_ids, progress=progress)

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool:
        """Remove documents (all of them if ``ids`` is ``None``); unknown ids are ignored."""
        _no_options("delete", kwargs)
        known = (
            self.store.documents if ids is None else [i for i in dict.fromkeys(ids) if i in self.store.manifest.docs]
        )
        if known:
            self.store.delete(known)
        return True

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        """The whole documents with these ids, in the given order; unknown ids are skipped."""
        docs = self.store.manifest.docs
        return [
            Document(page_content=_document_text(self.store, i), metadata=dict(docs[i].metadata), id=i)
            for i in ids
            if i in docs
        ]

    def similarity_search_with_score(self, query: str, k: int = 4, **kwargs: Any) -> list[tuple[Document, float]]:
        """The ``k`` chunks closest to ``query`` with their scores, best first."""
        _no_options("similarity_search", kwargs)
        return [
            (Document(page_content=h.text, metadata=dict(h.metadata), id=h.doc_id), h.score)
            for h in self.store.search(query, k)
        ]

    def similarity_search(self, query: str, k: int = 4, **kwargs: Any) -> list[Document]:
        """The ``k`` chunks closest to ``query``, best first."""
        return [doc for doc, _ in self.similarity_search_with_score(query, k, **kwargs)]

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        return _relevance

    def as_retriever(self, **kwargs: Any) -> PromptModuleRetriever:  # type: ignore[override]
        """A ``PromptModuleRetriever`` over the store: ``search_kwargs={"k": n}``, similarity search only."""
        search_type = kwargs.pop("search_type", "similarity")
        search_kwargs = dict(kwargs.pop("search_kwargs", None) or {})
        k = search_kwargs.pop("k", 4)
        if search_type != "similarity" or search_kwargs:
            msg = (
                f"PromptCacheVectorStore retrievers support search_type='similarity' with search_kwargs k only, "
                f"got search_type={search_type!r}, search_kwargs={sorted(search_kwargs)}"
            )
            raise PCRagError(msg)
        tags = [*(kwargs.pop("tags", None) or []), *self._get_retriever_tags()]
        return PromptModuleRetriever(store=self.store, k=k, tags=tags, **kwargs)


class _EmbedderEmbeddings(Embeddings):
    """A pc-rag ``Embedder`` seen as LangChain ``Embeddings``."""

    def __init__(self, embedder: Embedder) -> None:
        self.embedder = embedder

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self.embedder.embed_documents(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embedder.embed_query(text).tolist()


def _document_text(store: DocumentStore, doc_id: str) -> str:
    """A document's text, rebuilt from its chunks (they tile it, overlapping) and checked against its hash."""
    record = store.manifest.docs[doc_id]
    text = ""
    for cid in record.chunk_ids:
        chunk = store.manifest.chunks[cid]
        if chunk.end_char > len(text):
            text += chunk.text[len(text) - chunk.start_char :]
    if hashlib.sha256(text.encode()).hexdigest() != record.sha256:
        msg = f"document {doc_id!r} cannot be rebuilt from its chunks in {store.directory} (hash mismatch)"
        raise StoreError(msg)
    return text


def _relevance(score: float) -> float:
    """Cosine similarity in [-1, 1] to LangChain's relevance in [0, 1]."""
    return min(1.0, max(0.0, (score + 1.0) / 2.0))


def _no_options(method: str, kwargs: dict[str, Any]) -> None:
    if kwargs:
        msg = f"PromptCacheVectorStore.{method} does not support {sorted(kwargs)} (no metadata filters)"
        raise PCRagError(msg)
