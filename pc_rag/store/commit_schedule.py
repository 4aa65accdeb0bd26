"""When a long add commits: after a number of chunks or a number of seconds, whichever comes first.

A commit costs a new index file and manifest; committing too rarely makes a killed run lose its work. The
schedule cuts the documents to add into parts (whole documents) and says after which part a commit is due.
This module knows nothing about stores: the caller adds each part and commits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pc_rag.store.chunking import commit_parts

TIMED_PART = 32  # chunks per part when commits also follow the clock: how late a timed commit may come


@dataclass
class CommitSchedule:
    """Commit after ``every`` chunks (0: never by count) or ``seconds`` of ``clock`` since the last commit (0: never
    by time); ``pending`` counts the chunks added since."""

    every: int = 0
    seconds: float = 0.0
    clock: Callable[[], float] = time.monotonic
    pending: int = 0
    last: float = field(init=False)

    def __post_init__(self) -> None:
        self.last = self.clock()

    def parts(self, pieces: list[Any]) -> list[list[Any]]:
        """``pieces`` (documents with their chunk spans last) in the parts added one at a time."""
        step = min(self.every or TIMED_PART, TIMED_PART) if self.seconds > 0 else self.every
        return commit_parts(pieces, step)

    def added(self, part: list[Any]) -> bool:
        """Count ``part`` as added; whether a commit is due now."""
        self.pending += sum(len(piece[-1]) for piece in part)
        return (0 < self.every <= self.pending) or (self.seconds > 0 and self.clock() - self.last >= self.seconds)

    def committed(self) -> None:
        self.pending, self.last = 0, self.clock()
