"""Questions written by the model itself about a passage: the queries of training pairs drawn from a store.

The model is asked, in one user turn of its own chat template, for one question the passage
answers, and answers greedily; ``clean_question`` keeps the first line up to its first question
mark, unwraps "What is the answer to the question: ...", and drops what cannot serve as a query (empty,
a word or two, a runaway, a loop of one word, nothing in common with the passage).
No gold question or answer is involved. This module knows nothing about stores, teachers or training.
"""

from __future__ import annotations

import hashlib
import re

from pc_rag.rag.engine import RagEngine

INSTRUCTION = "Write a quiz question whose answer is found in the passage above."  # SmolLM2-135M echoed others
MAX_NEW_TOKENS = 48
MIN_WORDS, MAX_WORDS = 3, 40
_WRAPPER = re.compile(r"^(question:|what is the answer to (the|this) question\b[:?]?)\s*", re.IGNORECASE)
_WORD = re.compile(r"[^\W\d_]{4,}")
_GENERIC = {"what", "which", "when", "where", "whom", "whose", "name", "answer", "question", "passage", "this",
            "that", "there", "their", "with", "from", "about", "have", "does", "were", "been", "most",
            "your"}  # fmt: skip


def question_prompt(engine: RagEngine, passage: str) -> str:
    """The prompt text: the engine's system turn, then a user turn with the passage and the instruction."""
    wrappers, system = engine.wrappers, engine.prompt.system
    user = f"Passage:\n{passage.strip()}\n\n{INSTRUCTION}"
    return wrappers.wrap("system", system) + wrappers.wrap("user", user) + wrappers.generation_prompt


def prompt_digest(engine: RagEngine) -> str:
    """Identity of how questions are asked (template, instruction, length): a resumed run must ask the same way."""
    return hashlib.sha256(f"{question_prompt(engine, '{}')}\x00{MAX_NEW_TOKENS}".encode()).hexdigest()[:16]


def write_question(engine: RagEngine, passage: str) -> str:
    """The model's greedy reply (raw text) to ``question_prompt``, by full prefill."""
    stream = engine.stream_ids(engine.tokenize(question_prompt(engine, passage)), max_new_tokens=MAX_NEW_TOKENS)
    for _ in stream:
        pass
    assert stream.result is not None
    return stream.result.text


def clean_question(raw: str, passage: str | None = None) -> str | None:
    """The question in ``raw`` (first non-empty line, unwrapped, cut after its first ``?``), or None if it is
    degenerate; with ``passage``, also None when it shares no word of four letters or more with it (not generic)."""
    line = next((s.strip() for s in raw.splitlines() if s.strip()), "")
    while (unwrapped := _WRAPPER.sub("", line).strip().strip("\"'").strip()) != line:
        line = unwrapped
    if "?" in line:
        line = line[: line.index("?") + 1]
    words = line.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS or not any(c.isalpha() for c in line):
        return None
    if len({w.lower() for w in words}) < len(words) / 2:  # one word repeated: a decoding loop
        return None
    if passage is not None and not _content(line) & _content(passage):
        return None
    return line


def _content(text: str) -> set[str]:
    return {w for w in (m.lower() for m in _WORD.findall(text)) if w not in _GENERIC}
