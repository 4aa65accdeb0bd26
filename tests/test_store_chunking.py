"""Chunking properties on SmolLM2's real tokenizer: chunks tile the text, fit the budget, cut where a reader would."""

from __future__ import annotations

import random
import re
from itertools import pairwise

import pytest

from pc_rag.errors import ChunkingError
from pc_rag.store.chunking import ChunkSpan, split_text

_WORDS = ["the", "a", "river", "city", "council", "voted", "to", "build", "new", "bridge", "over", "old", "harbour"]
_SENTENCE_END = re.compile(r"[.!?]\s*$")


def _sentence(rng: random.Random, words: tuple[int, int]) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(*words)))
    return text[0].upper() + text[1:] + rng.choice(".!?")


def _document(seed: int, paragraphs: int, sentences: tuple[int, int], words: tuple[int, int] = (5, 14)) -> str:
    rng = random.Random(seed)
    return "\n\n".join(
        " ".join(_sentence(rng, words) for _ in range(rng.randint(*sentences))) for _ in range(paragraphs)
    )


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _assert_tiles(chunks: list[ChunkSpan], text: str) -> None:
    """Spans start at 0, end at len(text), never leave a gap, always advance, and stitch back to the text."""
    assert chunks[0].start_char == 0
    assert chunks[-1].end_char == len(text)
    for chunk in chunks:
        assert chunk.text == text[chunk.start_char : chunk.end_char]
    for a, b in pairwise(chunks):
        assert a.start_char < b.start_char <= a.end_char < b.end_char
    stitched = chunks[0].text + "".join(b.text[a.end_char - b.start_char :] for a, b in pairwise(chunks))
    assert stitched == text


MIXED = (
    _document(1, paragraphs=6, sentences=(2, 9))
    + "\n\nUnicode: café naïve 東京は雨です。明日も雨？ Emoji 😀🎉👍🏽 mixed in.\n"
    + "A line break\nthen tabs\tand   runs of   spaces.   \n\n\n"
    + "https://example.org/a/very/long/path?with=query&and=more " * 5
)


@pytest.mark.parametrize(("chunk_tokens", "overlap"), [(16, 0), (64, 0), (64, 16), (128, 32), (256, 32)])
def test_chunks_tile_the_text_and_fit_the_budget(tokenizer, chunk_tokens: int, overlap: int) -> None:
    chunks = split_text(MIXED, tokenizer, chunk_tokens=chunk_tokens, overlap_tokens=overlap)
    _assert_tiles(chunks, MIXED)
    for chunk in chunks:
        assert chunk.n_tokens == _count(tokenizer, chunk.text) <= chunk_tokens


def test_short_text_is_one_chunk(tokenizer) -> None:
    text = "  Just one sentence.  "
    assert split_text(text, tokenizer) == [ChunkSpan(text, 0, len(text), _count(tokenizer, text))]


def test_chunks_end_at_paragraph_breaks_when_paragraphs_fit(tokenizer) -> None:
    text = _document(2, paragraphs=30, sentences=(2, 3))
    chunks = split_text(text, tokenizer, chunk_tokens=128, overlap_tokens=0)
    assert len(chunks) > 3
    for chunk in chunks[:-1]:
        assert re.search(r"\n\s*\n\s*$", text[: chunk.end_char]) or re.match(r"\s*\n\s*\n", text[chunk.end_char :])
        assert chunk.n_tokens >= 64  # paragraphs are merged, not emitted one by one


def test_long_paragraphs_are_cut_at_sentence_ends(tokenizer) -> None:
    text = _document(3, paragraphs=1, sentences=(60, 60))
    chunks = split_text(text, tokenizer, chunk_tokens=64, overlap_tokens=0)
    assert len(chunks) > 5
    for chunk in chunks[:-1]:
        assert _SENTENCE_END.search(chunk.text), chunk.text[-30:]


def test_overlap_carries_whole_sentences_within_budget(tokenizer) -> None:
    text = _document(4, paragraphs=1, sentences=(80, 80), words=(3, 6))
    chunks = split_text(text, tokenizer, chunk_tokens=64, overlap_tokens=24)
    _assert_tiles(chunks, text)
    for a, b in pairwise(chunks):
        shared = text[b.start_char : a.end_char]
        assert shared.strip(), "consecutive chunks share text"
        assert _count(tokenizer, shared) <= 24
        assert _SENTENCE_END.search(text[: b.start_char]) or not text[: b.start_char].strip()


def test_no_overlap_means_disjoint_chunks(tokenizer) -> None:
    chunks = split_text(MIXED, tokenizer, chunk_tokens=48, overlap_tokens=0)
    for a, b in pairwise(chunks):
        assert a.end_char == b.start_char


@pytest.mark.parametrize("word", ["x" * 3000, "".join(random.Random(5).choices("abcdefghij0123456789", k=3000))])
def test_a_giant_word_is_cut_by_tokens(tokenizer, word: str) -> None:
    text = f"Before. {word} after."
    chunks = split_text(text, tokenizer, chunk_tokens=32, overlap_tokens=4)
    assert len(chunks) > 3
    _assert_tiles(chunks, text)
    assert all(c.n_tokens <= 32 for c in chunks)


@pytest.mark.parametrize("text", ["", "   ", "\n\n\t \r\n"])
def test_empty_text_gives_no_chunks(tokenizer, text: str) -> None:
    assert split_text(text, tokenizer) == []


@pytest.mark.parametrize(
    "text",
    [
        "PK\x03\x04\x00\x00 header of a zip",
        "".join(map(chr, range(1, 32))) * 20,
        bytes(random.Random(6).randrange(1, 256) for _ in range(4000)).decode("utf-8", errors="replace"),
    ],
    ids=["nul", "control", "decoded-binary"],
)
def test_binary_looking_text_is_refused(tokenizer, text: str) -> None:
    with pytest.raises(ChunkingError, match="binary"):
        split_text(text, tokenizer)


@pytest.mark.parametrize(("chunk_tokens", "overlap"), [(0, 0), (16, 16), (16, -1)])
def test_bad_budgets_are_refused(tokenizer, chunk_tokens: int, overlap: int) -> None:
    with pytest.raises(ValueError, match="tokens"):
        split_text("Some text.", tokenizer, chunk_tokens=chunk_tokens, overlap_tokens=overlap)
