"""How many drafts a speculative step verifies: the count with the most expected tokens per unit of step time.

A verify step of R rows costs more than a one-row step: each row adds its matmuls and its attention over the
whole cache (2-core Xeon, int4 SmolLM2, 4 rows against 1: 1.48x at 1K cached tokens, 1.67x at 4K, 1.80x at 8K,
``examples/verify_step_rows.py``), so a draft pays only where the tokens it keeps outweigh its row. ``StepCosts``
keeps the times of recent steps by row count and cache length (per model runner, across requests) and compares
their minima: a preempted step only ever takes longer, and one slow sample must not rule a row count out (the
policy would then stop trying it, and never see it was fast). ``DraftPolicy`` estimates, for one request, how often
the first draft is kept after a match of n tokens, apart per source (the request's tokens or the model's stock
phrases, ``PromptLookup.source``) and for matches whose every earlier occurrence was followed by the drafted token
(``PromptLookup.agreed``) and the others, and how often a kept draft's successor is (per source). It picks the
count k that maximizes

    (1 + p (1 + c + ... + c^(k-1))) / (cost(k + 1 rows) / cost(1 row))

where p is the first draft's estimated keep rate for the match and c the successor's. Both rates are kept apart by
how sure the model was of the step's fed token (its top softmax probability when it was picked, binned at
``CONFIDENCE_BINS``): where the model is copying it is sure of each token, and a draft copied from the text is
then kept about twice as often as after an unsure pick. A request's rates start from the runner's (``KeepRates``:
every request's verified steps pooled, from priors by confidence measured on the tuning split) and move with its
own steps; the costs start at ``PRIOR_ROW_COST`` a row until a step of that size was timed. Greedy outputs do not
depend on the count (a kept draft is the token plain decoding picks).
"""

from __future__ import annotations

import bisect
import os
import threading
from collections import deque

PRIOR_ROW_COST = 0.25
"""Cost of each extra row relative to a one-row step, until steps of both sizes were timed at a length."""
LENGTH_BUCKET = 1024
"""Cache lengths whose steps share a cost estimate (a step's attention grows with the cache)."""
WINDOW = 8
"""Recent steps per (row count, bucket) whose fastest is the cost estimate."""
POOLED_WEIGHT = 4.0
"""Pseudo-observations the runner's pooled keep rate counts for in a request's own estimate."""
CONFIDENCE_BINS = (0.3, 0.7, 0.95)
"""Edges of the fed token's top probability that split the keep rates (4 bins)."""
FIRST_PRIOR = (0.40, 0.44, 0.65, 0.78)
"""Per confidence bin: the share of first drafts kept, before any is seen. Measured on SmolLM2 int4's answers to 200
tuning-split questions, drafts from the request's own tokens (``examples/draft_confidence.py``,
``examples/results/draft_confidence.json``)."""
SUCCESSOR_PRIOR = (0.74, 0.76, 0.84, 0.84)
"""Per confidence bin: the share of drafts kept after a kept one, before any is seen (as ``FIRST_PRIOR``)."""
CONFIDENCE_SWITCH = "PC_RAG_DRAFT_CONFIDENCE"
"""``0`` pools every step's rates whatever the fed token's probability (the policy before confidence bins)."""


def confidence_bin(confidence: float | None) -> int:
    """The bin of a fed token's top probability (-1: not known)."""
    return -1 if confidence is None else bisect.bisect_left(CONFIDENCE_BINS, confidence)


def _prior(priors: tuple[float, ...], bin_: int) -> float:
    return priors[bin_] if bin_ >= 0 else 0.5


class StepCosts:
    """Milliseconds of recent decode steps by (row count, cache-length bucket): the fastest of the last ``WINDOW``."""

    def __init__(self) -> None:
        self._ms: dict[tuple[int, int], deque[float]] = {}
        self._lock = threading.Lock()

    def record(self, rows: int, length: int, ms: float) -> None:
        key = (rows, length // LENGTH_BUCKET)
        with self._lock:
            self._ms.setdefault(key, deque(maxlen=WINDOW)).append(ms)

    def relative(self, rows: int, length: int) -> float:
        """A step of ``rows`` rows over a one-row step at ``length`` cached tokens (at least 1)."""
        if rows <= 1:
            return 1.0
        bucket = length // LENGTH_BUCKET
        with self._lock:
            one, many = self._ms.get((1, bucket)), self._ms.get((rows, bucket))
            if one and many:
                return max(1.0, min(many) / min(one))
        return 1.0 + PRIOR_ROW_COST * (rows - 1)


class _Rate:
    """A keep rate: (kept + weight * prior) / (tried + weight); by default a uniform prior, (kept + 1) / (tried + 2)."""

    def __init__(self) -> None:
        self.kept = self.tried = 0

    def add(self, kept: int, tried: int) -> None:
        self.kept += kept
        self.tried += tried

    def value(self, prior: float = 0.5, weight: float = 2.0) -> float:
        return (self.kept + weight * prior) / (self.tried + weight)


Match = tuple[str, int, bool, int]
"""What a draft was looked up after: its source (``PromptLookup.source``), the matched suffix's length, whether its
occurrences agreed, and the fed token's confidence bin."""
Carry = tuple[str, int]
"""What a successor's rate is kept by: the source and the confidence bin."""


def carry_of(match: Match) -> Carry:
    """The successor key of a first draft's ``match``: its source and confidence bin."""
    return match[0], match[3]


class KeepRates:
    """Every request's verified drafts, pooled per runner: the prior of a new request's keep rates."""

    def __init__(self) -> None:
        self._first: dict[Match, _Rate] = {}
        self._next: dict[Carry, _Rate] = {}
        self._lock = threading.Lock()

    def first(self, match: Match) -> float:
        prior = _prior(FIRST_PRIOR, match[3])
        with self._lock:
            rate = self._first.get(match)
            return rate.value(prior) if rate else prior

    def successor(self, carry: Carry) -> float:
        prior = _prior(SUCCESSOR_PRIOR, carry[1])
        with self._lock:
            rate = self._next.get(carry)
            return rate.value(prior) if rate else prior

    def add(self, match: Match, first: tuple[int, int], successors: tuple[int, int]) -> None:
        with self._lock:
            self._first.setdefault(match, _Rate()).add(*first)
            self._next.setdefault(carry_of(match), _Rate()).add(*successors)


class DraftPolicy:
    """One request's draft counts: ``count`` before a verify step, ``observe`` after it."""

    def __init__(self, costs: StepCosts, pooled: KeepRates | None = None) -> None:
        self._costs = costs
        self._pooled = pooled if pooled is not None else KeepRates()
        self._first: dict[Match, _Rate] = {}
        self._next: dict[Carry, _Rate] = {}
        self._by_confidence = os.environ.get(CONFIDENCE_SWITCH, "1") != "0"

    def _match(self, source: str, matched: int, agreed: bool, confidence: float | None) -> Match:
        return source, matched, agreed, confidence_bin(confidence) if self._by_confidence else -1

    def count(
        self,
        matched: int,
        available: int,
        length: int,
        agreed: bool = False,
        source: str = "context",
        confidence: float | None = None,
    ) -> int:
        """How many of ``available`` drafts (looked up after a match of ``matched`` tokens, ``agreed`` and ``source``
        as ``PromptLookup``'s, after a fed token picked with top probability ``confidence``) to verify in a step
        over ``length`` cached tokens; 0 runs the step alone."""
        if matched <= 0 or available <= 0:
            return 0
        match = self._match(source, matched, agreed, confidence)
        carried = carry_of(match)
        own = self._first.get(match, _Rate())
        keep = own.value(self._pooled.first(match), POOLED_WEIGHT)
        carry = self._next.get(carried, _Rate()).value(self._pooled.successor(carried), POOLED_WEIGHT)
        best, best_value = 0, 1.0
        expected, term = 1.0, keep
        for k in range(1, available + 1):
            expected += term
            term *= carry
            value = expected / self._costs.relative(k + 1, length)
            if value > best_value:
                best, best_value = k, value
        return best

    def observe(
        self,
        matched: int,
        drafted: int,
        kept: int,
        agreed: bool = False,
        source: str = "context",
        confidence: float | None = None,
    ) -> None:
        """A verify step's outcome: ``kept`` of its ``drafted`` drafts (looked up as ``count``'s)."""
        if drafted <= 0:
            return
        match = self._match(source, matched, agreed, confidence)
        first = (int(kept > 0), 1)
        self._first.setdefault(match, _Rate()).add(*first)
        tried = min(kept, drafted - 1)  # drafts 2.. tried: each after a kept one
        successors = (tried if kept == drafted else tried - 1, tried) if tried else (0, 0)
        self._next.setdefault(carry_of(match), _Rate()).add(*successors)
        self._pooled.add(match, first, successors)
