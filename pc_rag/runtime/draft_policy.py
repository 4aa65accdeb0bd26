"""How many drafts a speculative step verifies: the count with the most expected tokens per unit of step time.

A verify step of R rows costs more than a one-row step: each row adds its matmuls and its attention over the
whole cache (2-core Xeon, int4 SmolLM2, 4 rows against 1: 1.55x at 1K cached tokens, 1.87x at 4K, 1.95x at 8K),
so a draft pays only where the tokens it keeps outweigh its row. ``StepCosts`` keeps the measured time of recent
steps by row count and cache length (per model runner, across requests); ``DraftPolicy`` keeps, for one request,
how often the first draft after a match of n tokens was kept and how often a kept draft's successor was, and
picks the count k that maximizes

    (1 + p_n (1 + c + ... + c^(k-1))) / (cost(k + 1 rows) / cost(1 row))

where p_n is the first draft's estimated keep rate after an n-token match and c the successor's. Both start at
1/2 (a uniform prior, updated by every verified step) and the costs at ``PRIOR_ROW_COST`` a row until a step of
that size was timed. Greedy outputs do not depend on the count (a kept draft is the token plain decoding picks).
"""

from __future__ import annotations

import threading

PRIOR_ROW_COST = 0.25
"""Cost of each extra row relative to a one-row step, until steps of both sizes were timed at a length."""
LENGTH_BUCKET = 1024
"""Cache lengths whose steps share a cost estimate (a step's attention grows with the cache)."""
SMOOTHING = 0.25
"""Weight of the newest step in a cost's moving average."""


class StepCosts:
    """Milliseconds of recent decode steps by (row count, cache-length bucket), as moving averages."""

    def __init__(self) -> None:
        self._ms: dict[tuple[int, int], float] = {}
        self._lock = threading.Lock()

    def record(self, rows: int, length: int, ms: float) -> None:
        key = (rows, length // LENGTH_BUCKET)
        with self._lock:
            old = self._ms.get(key)
            self._ms[key] = ms if old is None else old + SMOOTHING * (ms - old)

    def relative(self, rows: int, length: int) -> float:
        """A step of ``rows`` rows over a one-row step at ``length`` cached tokens (at least 1)."""
        if rows <= 1:
            return 1.0
        bucket = length // LENGTH_BUCKET
        with self._lock:
            one, many = self._ms.get((1, bucket)), self._ms.get((rows, bucket))
        if one and many:
            return max(1.0, many / one)
        return 1.0 + PRIOR_ROW_COST * (rows - 1)


class _Rate:
    """A keep rate from a uniform prior: (kept + 1) / (tried + 2)."""

    def __init__(self) -> None:
        self.kept = self.tried = 0

    def add(self, kept: int, tried: int) -> None:
        self.kept += kept
        self.tried += tried

    @property
    def value(self) -> float:
        return (self.kept + 1) / (self.tried + 2)


class DraftPolicy:
    """One request's draft counts: ``count`` before a verify step, ``observe`` after it."""

    def __init__(self, costs: StepCosts) -> None:
        self._costs = costs
        self._first: dict[int, _Rate] = {}
        self._next = _Rate()

    def count(self, matched: int, available: int, length: int) -> int:
        """How many of ``available`` drafts (looked up after a match of ``matched`` tokens) to verify in a step
        over ``length`` cached tokens; 0 runs the step alone."""
        if matched <= 0 or available <= 0:
            return 0
        first = self._first.get(matched)
        keep, carry = (first.value if first else 0.5), self._next.value
        best, best_value = 0, 1.0
        expected, term = 1.0, keep
        for k in range(1, available + 1):
            expected += term
            term *= carry
            value = expected / self._costs.relative(k + 1, length)
            if value > best_value:
                best, best_value = k, value
        return best

    def observe(self, matched: int, drafted: int, kept: int) -> None:
        """A verify step's outcome: ``kept`` of its ``drafted`` drafts (looked up after ``matched`` tokens)."""
        if drafted <= 0:
            return
        self._first.setdefault(matched, _Rate()).add(int(kept > 0), 1)
        successors = min(kept, drafted - 1)  # drafts 2.. tried: each after a kept one
        if successors:
            self._next.add(successors if kept == drafted else successors - 1, successors)
