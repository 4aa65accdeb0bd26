"""Vector index: flat equals brute force, HNSW and IVF recall well, removal and save/load keep results."""

from __future__ import annotations

import numpy as np
import pytest

from pc_rag.errors import StoreCorruptedError
from pc_rag.store.index import VectorIndex

DIM = 32


def _unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """3000 clustered unit vectors with sparse ids, and 50 queries near them."""
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((40, DIM))
    vectors = _unit(centers[rng.integers(0, 40, 3000)] + 0.6 * rng.standard_normal((3000, DIM)))
    ids = rng.choice(10**9, size=3000, replace=False).astype(np.int64)
    queries = _unit(vectors[:50] + 0.3 * rng.standard_normal((50, DIM)))
    return ids, vectors, queries


def _brute(ids: np.ndarray, vectors: np.ndarray, query: np.ndarray, k: int) -> list[tuple[int, float]]:
    scores = vectors @ query
    order = np.argsort(-scores, kind="stable")[:k]
    return [(int(ids[i]), float(scores[i])) for i in order]


def _recall(index: VectorIndex, ids: np.ndarray, vectors: np.ndarray, queries: np.ndarray, k: int) -> float:
    hits = 0
    for query, found in zip(queries, index.search_many(queries, k), strict=True):
        hits += len({i for i, _ in found} & {i for i, _ in _brute(ids, vectors, query, k)})
    return hits / (k * len(queries))


def test_flat_equals_brute_force(data) -> None:
    ids, vectors, queries = data
    index = VectorIndex(DIM)
    index.add(ids, vectors)
    for query in queries[:10]:
        found = index.search(query, 10)
        expected = _brute(ids, vectors, query, 10)
        assert [i for i, _ in found] == [i for i, _ in expected]
        np.testing.assert_allclose([s for _, s in found], [s for _, s in expected], rtol=1e-5)


@pytest.mark.parametrize(("kind", "floor"), [("hnsw", 0.9), ("ivf", 0.9)])
def test_approximate_kinds_recall(data, kind: str, floor: float) -> None:
    ids, vectors, queries = data
    index = VectorIndex(DIM, kind, m=16, nlist=16, nprobe=6)
    index.add(ids[:500], vectors[:500])
    assert index.trained == (kind != "ivf")  # 500 < 39 * 16: ivf still searches exactly
    index.add(ids[500:], vectors[500:])
    assert index.trained
    assert _recall(index, ids, vectors, queries, 10) >= floor


def test_untrained_ivf_is_exact(data) -> None:
    ids, vectors, queries = data
    index = VectorIndex(DIM, "ivf", nlist=100)
    index.add(ids[:1000], vectors[:1000])
    assert not index.trained
    assert _recall(index, ids[:1000], vectors[:1000], queries, 10) == 1.0


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_removed_ids_never_come_back(data, kind: str, tmp_path) -> None:
    ids, vectors, queries = data
    index = VectorIndex(DIM, kind, nlist=16, nprobe=16)
    index.add(ids, vectors)
    gone = ids[:1500]
    assert index.remove([*gone.tolist(), 12345678901]) == 1500
    assert len(index) == 1500 and int(gone[0]) not in index
    live_ids, live_vectors = ids[1500:], vectors[1500:]
    for query in queries[:10]:
        found = [i for i, _ in index.search(query, 20)]
        assert len(found) == 20 and not set(found) & set(gone.tolist())
    assert _recall(index, live_ids, live_vectors, queries, 10) >= 0.95
    index.add(gone[:5], vectors[:5])  # removed ids can be added again
    assert index.search(vectors[0], 1)[0][0] == gone[0]
    index.save(tmp_path / "index.faiss")
    loaded = VectorIndex.load(tmp_path / "index.faiss")
    assert len(loaded) == 1505 and loaded.kind == kind
    assert loaded.search(vectors[0], 1)[0][0] == gone[0]


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf"])
def test_save_load_round_trip(data, kind: str, tmp_path) -> None:
    ids, vectors, queries = data
    index = VectorIndex(DIM, kind, m=8, ef_search=32, nlist=16, nprobe=3)
    index.add(ids, vectors)
    path = tmp_path / "sub" / "index.faiss"
    path.parent.mkdir()
    index.save(path)
    assert [p.name for p in path.parent.iterdir()] == ["index.faiss"]  # no temp file left
    loaded = VectorIndex.load(path)
    assert loaded.config == index.config and len(loaded) == len(index) and loaded.trained
    assert loaded.search_many(queries, 5) == index.search_many(queries, 5)


def test_k_beyond_size_returns_everything_and_k_below_one_is_refused(data) -> None:
    ids, vectors, _ = data
    index = VectorIndex(DIM)
    assert index.search(vectors[0], 5) == []
    index.add(ids[:3], vectors[:3])
    assert sorted(i for i, _ in index.search(vectors[0], 100)) == sorted(ids[:3].tolist())
    with pytest.raises(ValueError, match="k must be at least 1"):
        index.search(vectors[0], 0)


def test_bad_input_is_refused(data, tmp_path) -> None:
    ids, vectors, _ = data
    index = VectorIndex(DIM)
    index.add(ids[:3], vectors[:3])
    with pytest.raises(ValueError, match="already in the index"):
        index.add(ids[:1], vectors[:1])
    with pytest.raises(ValueError, match=r"shape \[N, 32\]"):
        index.add([7], np.ones((1, DIM + 1)))
    with pytest.raises(ValueError, match="distinct and non-negative"):
        index.add([-1], vectors[:1])
    with pytest.raises(ValueError, match="unknown index kind"):
        VectorIndex(DIM, "annoy")
    bad = tmp_path / "bad.faiss"
    bad.write_bytes(b"not an index at all")
    with pytest.raises(StoreCorruptedError, match="not a pc-rag vector index"):
        VectorIndex.load(bad)
    with pytest.raises(StoreCorruptedError, match="missing"):
        VectorIndex.load(tmp_path / "absent.faiss")
