"""Embedders: the bundled MiniLM ranks paraphrases first; adapters accept framework objects; bad outputs are refused."""

from __future__ import annotations

import numpy as np
import pytest

from pc_rag.errors import EmbeddingError
from pc_rag.store.embeddings import (
    CallableEmbedder,
    Embedder,
    LangChainEmbedder,
    LlamaIndexEmbedder,
    SentenceTransformerEmbedder,
    as_embedder,
)


@pytest.fixture(scope="module")
def minilm() -> SentenceTransformerEmbedder:
    return SentenceTransformerEmbedder(batch_size=16)


def _bag_of_letters(texts: list[str]) -> np.ndarray:
    """A deterministic toy embedding: letter counts (26-d)."""
    return np.array([[t.lower().count(c) + 1 for c in "abcdefghijklmnopqrstuvwxyz"] for t in texts], dtype=float)


class FakeLangChain:
    """Duck-types ``langchain_core.embeddings.Embeddings``."""

    model = "letters-v1"

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return _bag_of_letters(texts).tolist()

    def embed_query(self, text: str) -> list[float]:
        return _bag_of_letters([text])[0].tolist()


class FakeLlamaIndex:
    """Duck-types ``llama_index.core.base.embeddings.base.BaseEmbedding``."""

    model_name = "letters-v1"

    def get_text_embedding_batch(self, texts: list[str], **kwargs) -> list[list[float]]:
        return _bag_of_letters(texts).tolist()

    def get_query_embedding(self, query: str) -> list[float]:
        return _bag_of_letters([query])[0].tolist()


def test_minilm_ranks_the_paraphrase_first(minilm: SentenceTransformerEmbedder) -> None:
    passages = [
        "The Eiffel Tower was finished in 1889 for the World's Fair in Paris.",
        "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar.",
        "The stock market fell sharply after the central bank raised interest rates.",
        "Penguins are flightless birds that live mostly in the Southern Hemisphere.",
        "A recipe for bread needs flour, water, salt and yeast.",
    ]
    queries = [
        "When was the tower in Paris completed?",
        "How do plants make food from light?",
        "Why did share prices drop when rates went up?",
        "Which birds cannot fly and live in the south?",
        "What ingredients do I need to bake a loaf?",
    ]
    docs = minilm.embed_documents(passages)
    assert docs.shape == (5, 384) and docs.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(docs, axis=1), 1.0, atol=1e-5)
    for i, query in enumerate(queries):
        assert int(np.argmax(docs @ minilm.embed_query(query))) == i, query


def test_minilm_identity(minilm: SentenceTransformerEmbedder) -> None:
    assert minilm.dim == 384
    assert minilm.name == "sentence-transformers:all-MiniLM-L6-v2"
    assert isinstance(minilm, Embedder)
    assert as_embedder(minilm) is minilm
    assert minilm.embed_documents([]).shape == (0, 384)


@pytest.mark.parametrize(
    ("obj", "cls", "name"),
    [
        (_bag_of_letters, CallableEmbedder, "callable:test_store_embeddings._bag_of_letters"),
        (FakeLangChain(), LangChainEmbedder, "langchain:test_store_embeddings.FakeLangChain:letters-v1"),
        (FakeLlamaIndex(), LlamaIndexEmbedder, "llama-index:test_store_embeddings.FakeLlamaIndex:letters-v1"),
    ],
    ids=["callable", "langchain", "llamaindex"],
)
def test_adapters_embed_like_the_wrapped_object(obj: object, cls: type, name: str) -> None:
    embedder = as_embedder(obj)
    assert type(embedder) is cls and embedder.name == name
    assert embedder.dim == 26
    texts = ["apple", "banana", "zebra zone"]
    expected = _bag_of_letters(texts)
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    np.testing.assert_allclose(embedder.embed_documents(texts), expected, rtol=1e-6)
    np.testing.assert_allclose(embedder.embed_query("banana"), expected[1], rtol=1e-6)


def test_normalization_can_be_turned_off() -> None:
    raw = as_embedder(_bag_of_letters, normalize=False, name="letters")
    assert raw.name == "letters"
    np.testing.assert_array_equal(raw.embed_documents(["ab"]), _bag_of_letters(["ab"]).astype(np.float32))


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda texts: np.ones(len(texts)), "shape"),
        (lambda texts: np.ones((len(texts) + 1, 4)), "shape"),
        (lambda texts: np.ones((len(texts), 0)), "shape"),
        (lambda texts: np.full((len(texts), 4), np.nan), "NaN"),
        (lambda texts: [[1.0, 2.0], [3.0]][: len(texts) + 1], "not a numeric array|shape"),
        (lambda texts: [["a", "b"]] * len(texts), "not a numeric array"),
    ],
    ids=["1-d", "extra-row", "zero-width", "nan", "ragged", "strings"],
)
def test_bad_outputs_raise_embedding_error(fn, match: str) -> None:
    with pytest.raises(EmbeddingError, match=match):
        CallableEmbedder(fn).embed_documents(["one", "two"])


def test_changing_dimension_is_refused() -> None:
    widths = iter([4, 5])
    embedder = CallableEmbedder(lambda texts: np.ones((len(texts), next(widths))))
    embedder.embed_documents(["a"])
    with pytest.raises(EmbeddingError, match="changed dimension"):
        embedder.embed_documents(["b"])


def test_unusable_objects_are_refused() -> None:
    with pytest.raises(TypeError, match="cannot use int as an embedder"):
        as_embedder(42)
    with pytest.raises(TypeError, match="takes strings"):
        CallableEmbedder(_bag_of_letters).embed_documents(["ok", 3])
