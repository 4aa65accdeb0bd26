"""Nearest-neighbour search over chunk embeddings with FAISS, by inner product, keyed by stable int64 ids.

Kinds:

* ``flat``: exact search (``IndexIDMap2`` over ``IndexFlatIP``); the default.
* ``hnsw``: ``IndexHNSWFlat`` (inner product, ``m`` links per node) in an
  ``IndexIDMap2``. FAISS cannot delete from HNSW, so ``remove`` records
  tombstones: searches fetch ``k + len(tombstones)`` neighbours and drop the
  dead ones, and ``compact()`` (also run by ``save``) rebuilds the graph
  without them.
* ``ivf``: ``IndexIVFFlat`` (inner product, ``nlist`` cells, ``nprobe`` visited).
  k-means needs data: until the index holds ``39 * nlist`` vectors (FAISS's
  minimum for stable centroids) it stays an exact flat index, and it trains
  and moves its vectors into IVF cells once it reaches that size. IVF keeps
  ids natively (an ``IndexIDMap2`` over IVF returns wrong ids after a removal).

Files hold a small JSON header (kind and parameters) then the index as
``faiss.write_index`` writes it; no pickle. Thread-safe: one lock around every
use of the FAISS index (FAISS cannot add and search at once). This module
knows nothing about texts, chunks or KV: ids are the caller's.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import faiss
import numpy as np

from pc_rag.errors import StoreCorruptedError, StoreError
from pc_rag.store._atomic import atomic_write

logger = logging.getLogger(__name__)

KINDS = ("flat", "hnsw", "ivf")
FORMAT_VERSION = 1
_MAGIC = b"PCRAGVI\x01"
_IVF_POINTS_PER_CELL = 39  # FAISS warns below 39 training points per centroid


def _locked(method: Callable) -> Callable:
    """Run ``method`` holding the index's lock."""

    @functools.wraps(method)
    def wrapper(self: VectorIndex, *args: object, **kwargs: object) -> object:
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class IndexConfig:
    """Kind and parameters of a ``VectorIndex``; unused parameters are ignored by the other kinds."""

    dim: int
    kind: str = "flat"
    m: int = 32  # hnsw: links per node
    ef_search: int = 128  # hnsw: candidate list size at search time
    nlist: int = 64  # ivf: number of cells
    nprobe: int = 8  # ivf: cells visited per query

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            msg = f"unknown index kind {self.kind!r}; choose one of {', '.join(KINDS)}"
            raise ValueError(msg)
        if min(self.dim, self.m, self.ef_search, self.nlist, self.nprobe) < 1:
            msg = f"index dimensions and parameters must be positive: {self}"
            raise ValueError(msg)

    @property
    def train_size(self) -> int:
        """Vectors an ``ivf`` index waits for before it trains."""
        return _IVF_POINTS_PER_CELL * self.nlist


class VectorIndex:
    """Inner-product search over vectors [N, dim] with int64 ids (>= 0); see the module docstring for kinds."""

    def __init__(
        self, dim: int, kind: str = "flat", *, m: int = 32, ef_search: int = 128, nlist: int = 64, nprobe: int = 8
    ) -> None:
        self.config = IndexConfig(dim=dim, kind=kind, m=m, ef_search=ef_search, nlist=nlist, nprobe=nprobe)
        self._index = self._empty()
        self._ids: set[int] = set()
        self._tombstones: set[int] = set()
        self._lock = threading.RLock()

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def trained(self) -> bool:
        """False only for an ``ivf`` index still searching exactly (fewer than ``train_size`` vectors so far)."""
        return self.kind != "ivf" or isinstance(self._index, faiss.IndexIVF)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._ids

    @_locked
    def ids(self) -> list[int]:
        return sorted(self._ids)

    @_locked
    def add(self, ids: Iterable[int], vectors: np.ndarray) -> None:
        """Add ``vectors`` [N, dim] under ``ids`` [N]; ids must be new (remove them first to replace)."""
        id_array = np.fromiter(ids, dtype=np.int64)
        matrix = self._matrix(vectors)
        if len(id_array) != len(matrix):
            msg = f"got {len(id_array)} ids for {len(matrix)} vectors"
            raise ValueError(msg)
        new = {int(i) for i in id_array}
        if len(new) != len(id_array) or (id_array < 0).any():
            msg = "ids must be distinct and non-negative"
            raise ValueError(msg)
        if present := sorted(new & self._ids)[:5]:
            msg = f"ids already in the index: {present}; remove them before adding them again"
            raise ValueError(msg)
        if new & self._tombstones:
            self.compact()  # a removed HNSW id is coming back: drop its dead copy first
        if len(matrix):
            self._index.add_with_ids(matrix, id_array)
        self._ids |= new
        if not self.trained and len(self) >= self.config.train_size:
            self._train_ivf()

    @_locked
    def remove(self, ids: Iterable[int]) -> int:
        """Remove ``ids`` (unknown ones are ignored); return how many were removed."""
        gone = {int(i) for i in ids} & self._ids
        if not gone:
            return 0
        if self.kind == "hnsw":
            self._tombstones |= gone
        else:
            self._index.remove_ids(np.fromiter(sorted(gone), dtype=np.int64))
        self._ids -= gone
        return len(gone)

    def search(self, vector: np.ndarray, k: int) -> list[tuple[int, float]]:
        """The ``k`` best ``(id, inner product)`` pairs for one query [dim], best first (all of them if k > len)."""
        return self.search_many(np.asarray(vector, dtype=np.float32).reshape(1, -1), k)[0]

    @_locked
    def search_many(self, queries: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
        """``search`` for each row of ``queries`` [Q, dim]; IVF and HNSW may return fewer than k (approximate)."""
        if k < 1:
            msg = f"k must be at least 1, got {k}"
            raise ValueError(msg)
        matrix = self._matrix(queries)
        if not self._ids:
            return [[] for _ in range(len(matrix))]
        want = min(k, len(self._ids))
        fetch = min(want + len(self._tombstones), self._index.ntotal)  # oversample past dead HNSW entries
        scores, labels = self._index.search(matrix, fetch)
        dead = self._tombstones
        return [
            [(int(i), float(s)) for s, i in zip(row_s, row_i, strict=True) if i >= 0 and int(i) not in dead][:want]
            for row_s, row_i in zip(scores, labels, strict=True)
        ]

    @_locked
    def compact(self) -> None:
        """Rebuild an HNSW graph without its tombstoned entries (a no-op otherwise)."""
        if not self._tombstones:
            return
        vectors, ids = _vectors_of(self._index), _ids_of(self._index)
        keep = ~np.isin(ids, np.fromiter(self._tombstones, dtype=np.int64))
        logger.info("rebuilding hnsw index without %d removed vectors", int((~keep).sum()))
        self._index = self._empty()
        self._index.add_with_ids(vectors[keep], ids[keep])
        self._tombstones.clear()

    @_locked
    def save(self, path: str | Path) -> None:
        """Write the index to ``path`` atomically (compacting first)."""
        self.compact()
        header = json.dumps({"format_version": FORMAT_VERSION, **asdict(self.config)}).encode()

        def write(f) -> None:
            f.write(_MAGIC + len(header).to_bytes(4, "little") + header)
            faiss.write_index(self._index, faiss.PyCallbackIOWriter(f.write))

        atomic_write(Path(path), write)

    @classmethod
    def load(cls, path: str | Path) -> VectorIndex:
        """Read an index written by ``save``; ``StoreCorruptedError`` if the file is not one."""
        path = Path(path)
        try:
            with open(path, "rb") as f:
                if f.read(len(_MAGIC)) != _MAGIC:
                    msg = f"{path} is not a pc-rag vector index file"
                    raise StoreCorruptedError(msg)
                header = json.loads(f.read(int.from_bytes(f.read(4), "little")))
                version = header.pop("format_version", None)
                if version != FORMAT_VERSION:
                    msg = f"{path} has index format {version!r}; this pc-rag reads format {FORMAT_VERSION}"
                    raise StoreError(msg)
                config = IndexConfig(**header)
                index = faiss.read_index(faiss.PyCallbackIOReader(f.read))
        except FileNotFoundError as e:
            msg = f"vector index file is missing: {path}"
            raise StoreCorruptedError(msg) from e
        except (RuntimeError, ValueError, TypeError) as e:
            msg = f"vector index file {path} is damaged: {e}"
            raise StoreCorruptedError(msg) from e
        out = cls.__new__(cls)
        out.config, out._tombstones, out._lock = config, set(), threading.RLock()
        out._index = out._configure(index)
        out._ids = {int(i) for i in _ids_of(index)}
        if index.d != config.dim or len(out._ids) != index.ntotal:
            msg = (
                f"vector index file {path} is inconsistent: dim {index.d}, {index.ntotal} vectors, {len(out._ids)} ids"
            )
            raise StoreCorruptedError(msg)
        return out

    def _empty(self) -> faiss.Index:
        d = self.config.dim
        if self.kind == "hnsw":
            return self._configure(faiss.IndexIDMap2(faiss.IndexHNSWFlat(d, self.config.m, faiss.METRIC_INNER_PRODUCT)))
        return self._configure(faiss.IndexIDMap2(faiss.IndexFlatIP(d)))  # flat, and ivf until trained

    def _configure(self, index: faiss.Index) -> faiss.Index:
        """Apply the search-time parameters to ``index``."""
        if isinstance(index, faiss.IndexIVF):
            index.nprobe = self.config.nprobe
        elif self.kind == "hnsw":
            faiss.downcast_index(index.index).hnsw.efSearch = self.config.ef_search
        return index

    def _train_ivf(self) -> None:
        vectors, ids = _vectors_of(self._index), _ids_of(self._index)
        logger.info("training ivf index (%d cells) on %d vectors", self.config.nlist, len(ids))
        ivf = faiss.IndexIVFFlat(faiss.IndexFlatIP(self.dim), self.dim, self.config.nlist, faiss.METRIC_INNER_PRODUCT)
        ivf.train(vectors)
        ivf.add_with_ids(vectors, ids)
        self._index = self._configure(ivf)

    def _matrix(self, vectors: np.ndarray) -> np.ndarray:
        matrix = np.ascontiguousarray(vectors, dtype=np.float32)
        if matrix.ndim != 2 or matrix.shape[1] != self.dim:
            msg = f"expected vectors of shape [N, {self.dim}], got {matrix.shape}"
            raise ValueError(msg)
        return matrix

    @_locked
    def tune(self, *, ef_search: int | None = None, nprobe: int | None = None) -> None:
        """Change search breadth (HNSW ``ef_search``, IVF ``nprobe``): more recall, slower search."""
        changes = {"ef_search": ef_search, "nprobe": nprobe}
        self.config = replace(self.config, **{k: v for k, v in changes.items() if v is not None})
        self._configure(self._index)


def _ids_of(index: faiss.Index) -> np.ndarray:
    """All stored ids [N] of an ``IndexIDMap2`` or an ``IndexIVF``."""
    if isinstance(index, faiss.IndexIVF):
        lists = index.invlists
        parts = [
            faiss.rev_swig_ptr(lists.get_ids(c), n).copy() for c in range(index.nlist) if (n := lists.list_size(c))
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return faiss.vector_to_array(index.id_map).astype(np.int64)


def _vectors_of(index: faiss.IndexIDMap2) -> np.ndarray:
    """All stored vectors [N, d] of an ``IndexIDMap2``, in id-map order."""
    return faiss.downcast_index(index.index).reconstruct_n(0, index.ntotal)
