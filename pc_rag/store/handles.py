"""What retrieval hands back: a module handle, the chunk to splice and its source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModuleHandle:
    """A retrieved chunk: what the LLM splices (by ``chunk_id``) and what a user shows as a source."""

    chunk_id: int
    score: float
    n_tokens: int
    text: str
    doc_id: str
    metadata: dict[str, Any] = field(default_factory=dict)
