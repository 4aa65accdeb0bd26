"""Split a document into chunks that fit a token budget, cutting at the most natural boundary.

The text is tokenized once with character offsets; every gap between two
tokens is a candidate cut, ranked paragraph (blank line) > sentence (end
punctuation or a line break) > whitespace > inside a word. Each chunk ends at
the best-ranked cut in the back half of its budget, the next one starts a few
whole sentences earlier (the overlap). Chunks tile the text: their character
spans cover ``[0, len(text))`` with no gap. This module knows nothing about
models, embeddings or KV; it only needs a fast (offset-reporting) tokenizer.
"""

from __future__ import annotations

import bisect
import logging
import re
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from pc_rag.errors import ChunkingError

logger = logging.getLogger(__name__)

# Rank of a cut between two tokens; -1 means no cut is possible there (both tokens map to one character).
NONE, TOKEN, WORD, SENTENCE, PARAGRAPH = -1, 0, 1, 2, 3

_WHITESPACE = re.compile(r"\s+")
_SENTENCE_END = re.compile(r"[.!?…。！？][\"'”’»)\]]*$")
_BINARY_SHARE = 0.3  # above this share of control/replacement characters a text is taken as binary
_SAMPLE = 1 << 16


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk: ``text == source[start_char:end_char]``; ``n_tokens`` counts it tokenized on its own."""

    text: str
    start_char: int
    end_char: int
    n_tokens: int


def split_text(
    text: str,
    tokenizer: PreTrainedTokenizerBase,
    chunk_tokens: int = 256,
    overlap_tokens: int = 32,
) -> list[ChunkSpan]:
    """Split ``text`` into chunks of at most ``chunk_tokens`` tokens (``add_special_tokens=False``).

    Consecutive chunks share up to ``overlap_tokens`` tokens, whole sentences
    where possible. Empty or whitespace-only text gives ``[]``; text that looks
    binary raises ``ChunkingError``.
    """
    if chunk_tokens < 1:
        msg = f"chunk_tokens must be at least 1, got {chunk_tokens}"
        raise ValueError(msg)
    if not 0 <= overlap_tokens < chunk_tokens:
        msg = f"overlap_tokens must be in [0, chunk_tokens={chunk_tokens}), got {overlap_tokens}"
        raise ValueError(msg)
    if not text.strip():
        return []
    _check_textual(text)
    starts = _token_starts(text, tokenizer)
    n = len(starts)
    if n == 0:  # every character was dropped by the tokenizer's normalizer
        return [ChunkSpan(text, 0, len(text), 0)]
    levels = _cut_levels(text, starts)

    def char_at(boundary: int) -> int:
        return 0 if boundary == 0 else len(text) if boundary == n else starts[boundary]

    chunks: list[ChunkSpan] = []
    start, floor = 0, 0  # floor: the previous chunk's end; a new chunk must pass it
    while True:
        window = chunk_tokens
        while True:
            end = _pick_end(levels, start, floor, n, window)
            piece = text[char_at(start) : char_at(end)]
            count = len(tokenizer(piece, add_special_tokens=False)["input_ids"])
            if count <= chunk_tokens:
                break
            # Re-tokenized on its own the piece merges differently at its edges (rare): shrink the window.
            window -= count - chunk_tokens
            if start + window <= floor:
                msg = f"cannot fit text at characters {char_at(start)}.. into {chunk_tokens} tokens"
                raise ChunkingError(msg)
        chunks.append(ChunkSpan(piece, char_at(start), char_at(end), count))
        if end == n:
            break
        start, floor = _pick_overlap_start(levels, start, end, overlap_tokens), end
    logger.debug("split %d characters (%d tokens) into %d chunks", len(text), n, len(chunks))
    return chunks


def _check_textual(text: str) -> None:
    """Refuse text with NUL bytes or mostly control / replacement characters (a decoded binary file)."""
    if "\x00" in text:
        msg = "text contains NUL characters and looks binary: extract its text before indexing it"
        raise ChunkingError(msg)
    sample = text[:_SAMPLE]
    bad = sum(1 for c in sample if c == "\ufffd" or (not c.isprintable() and not c.isspace()))
    if bad > _BINARY_SHARE * len(sample):
        msg = (
            f"text looks binary: {bad} of its first {len(sample)} characters are control or "
            "replacement characters; extract its text before indexing it"
        )
        raise ChunkingError(msg)


def _token_starts(text: str, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Character offset where each token of ``text`` starts (tokenized once, without special tokens)."""
    if not getattr(tokenizer, "is_fast", False):
        msg = f"chunking needs a fast tokenizer that reports character offsets; {type(tokenizer).__name__} does not"
        raise ChunkingError(msg)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [start for start, _ in encoding["offset_mapping"]]


def _cut_levels(text: str, starts: list[int]) -> list[int]:
    """``levels[b]``: rank of a cut before token ``b`` (``levels[0]`` unused: the first chunk starts at 0)."""
    runs = [(m.start(), m.end()) for m in _WHITESPACE.finditer(text)]
    run_starts = [r[0] for r in runs]
    levels = [NONE] * len(starts)
    for b in range(1, len(starts)):
        pos = starts[b]
        if pos <= starts[b - 1]:
            continue  # several byte tokens of one character
        i = bisect.bisect_right(run_starts, pos) - 1
        if i < 0 or runs[i][1] < pos:
            levels[b] = TOKEN
            continue
        run_start, run_end = runs[i]
        newlines = text.count("\n", run_start, run_end)
        if run_start < pos < run_end:
            levels[b] = WORD  # inside a whitespace run: cut at either end of it instead
        elif newlines >= 2:
            levels[b] = PARAGRAPH
        elif newlines == 1 or _SENTENCE_END.search(text, max(0, run_start - 4), run_start):
            levels[b] = SENTENCE
        else:
            levels[b] = WORD
    return levels


def _latest(levels: list[int], lo: int, hi: int, level: int) -> int | None:
    """The last boundary in ``[lo, hi]`` ranked at least ``level``."""
    for b in range(hi, lo - 1, -1):
        if levels[b] >= level:
            return b
    return None


def _pick_end(levels: list[int], start: int, floor: int, n: int, window: int) -> int:
    """End of a chunk from ``start``: the best cut in the back half of ``window``, else a word gap, else a hard cut."""
    limit = start + window
    if limit >= n:
        return n
    preferred = max(floor + 1, start + window // 2)
    for level in (PARAGRAPH, SENTENCE, WORD):
        end = _latest(levels, preferred, limit, level)
        if end is not None:
            return end
    end = _latest(levels, floor + 1, limit, WORD)
    if end is None:
        end = _latest(levels, floor + 1, limit, TOKEN)
    if end is None:
        msg = f"chunk_tokens={window} is too small: one character needs more tokens than that"
        raise ChunkingError(msg)
    return end


def _pick_overlap_start(levels: list[int], start: int, end: int, overlap: int) -> int:
    """Start of the next chunk: the earliest sentence (else word, else token) start in the last ``overlap`` tokens."""
    if overlap == 0:
        return end
    lo = max(start + 1, end - overlap)
    for level in (SENTENCE, WORD, TOKEN):
        for b in range(lo, end):
            if levels[b] >= level:
                return b
    return end


def commit_parts(pieces: list[Any], chunks_per_part: int) -> list[list[Any]]:
    """``pieces`` (documents with their ``spans`` last) in runs of about ``chunks_per_part`` chunks (0: one run)."""
    if chunks_per_part <= 0:
        return [pieces] if pieces else []
    parts: list[list[Any]] = [[]]
    count = 0
    for piece in pieces:
        if count >= chunks_per_part:
            parts.append([])
            count = 0
        parts[-1].append(piece)
        count += len(piece[-1])
    return parts if parts[0] else []
