"""What retrieval and answering hand back: module handles (a chunk to splice, and its source) and answers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pc_rag.generate import GenerationResult


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
