"""The draft policy: the count of drafts with the most expected tokens per unit of measured step time."""

from __future__ import annotations

import pytest
import torch

from pc_rag.runtime.draft_policy import (
    CONFIDENCE_BINS,
    CONFIDENCE_SWITCH,
    FIRST_PRIOR,
    LENGTH_BUCKET,
    PRIOR_ROW_COST,
    SUCCESSOR_PRIOR,
    WINDOW,
    DraftPolicy,
    KeepRates,
    StepCosts,
    confidence_bin,
)
from pc_rag.runtime.generate import top_probability


def _costs(per_row: float, length: int = 0) -> StepCosts:
    """Costs with steps of 1 to 4 rows timed at ``length``: ``1 + per_row * (rows - 1)`` milliseconds."""
    costs = StepCosts()
    for rows in range(1, 5):
        costs.record(rows, length, 1.0 + per_row * (rows - 1))
    return costs


def test_costs_are_measured_ratios_per_length_bucket_with_a_prior_until_both_sizes_ran() -> None:
    costs = StepCosts()
    assert costs.relative(1, 0) == 1.0
    assert costs.relative(3, 0) == pytest.approx(1 + 2 * PRIOR_ROW_COST)  # nothing timed yet
    costs.record(3, 100, 15.0)
    assert costs.relative(3, 0) == pytest.approx(1 + 2 * PRIOR_ROW_COST)  # no one-row step to compare with
    costs.record(1, 200, 10.0)
    assert costs.relative(3, 0) == pytest.approx(1.5)
    assert costs.relative(3, LENGTH_BUCKET) == pytest.approx(1 + 2 * PRIOR_ROW_COST)  # another bucket
    costs.record(3, 300, 25.0)  # a slow step (preempted, say) does not raise it: the fastest recent step counts
    assert costs.relative(3, 0) == pytest.approx(1.5)
    for _ in range(WINDOW):  # ... until the steps of that size have been slow for a whole window
        costs.record(3, 0, 25.0)
    assert costs.relative(3, 0) == pytest.approx(2.5)
    costs.record(2, 0, 5.0)  # measured cheaper than one row (noise): never below 1
    assert costs.relative(2, 0) == 1.0


def test_count_maximizes_expected_tokens_per_step_cost() -> None:
    free = DraftPolicy(_costs(0.0))
    assert free.count(matched=1, available=3, length=0) == 3  # rows cost nothing: every draft
    assert free.count(matched=0, available=3, length=0) == 0  # no match
    assert free.count(matched=2, available=0, length=0) == 0
    # keep rates start at 1/2: 1 draft gives 1.5 tokens, 2 give 1.75, 3 give 1.875
    assert DraftPolicy(_costs(0.15)).count(1, 3, 0) == 2  # 1.5/1.15 = 1.30, 1.75/1.3 = 1.35, 1.875/1.45 = 1.29
    assert DraftPolicy(_costs(0.45)).count(1, 3, 0) == 1  # 1.5/1.45 > 1 > 1.75/1.9
    assert DraftPolicy(_costs(0.6)).count(1, 3, 0) == 0  # 1.5/1.6 < 1: the step alone


def test_observed_keeps_move_the_count_per_match_length() -> None:
    policy = DraftPolicy(_costs(0.3))
    before = policy.count(1, 3, 0)
    assert before >= 1
    for _ in range(10):
        policy.observe(matched=1, drafted=3, kept=0)  # after 1-token matches the first draft is never kept
        policy.observe(matched=3, drafted=3, kept=3)  # after 3-token matches every draft is
    assert policy.count(1, 3, 0) == 0
    assert policy.count(3, 3, 0) == 3
    assert policy.count(2, 3, 0) == 3  # unseen length: the prior's 1/2, with the successors' rate learned (high)


def test_observe_counts_each_successor_tried_after_a_kept_draft() -> None:
    policy = DraftPolicy(_costs(0.0))
    policy.observe(matched=2, drafted=3, kept=1)  # draft 2 tried after draft 1 was kept, and rejected
    assert (policy._next["context", -1].kept, policy._next["context", -1].tried) == (0, 1)
    policy.observe(matched=2, drafted=3, kept=3)  # drafts 2 and 3 tried and kept
    assert (policy._next["context", -1].kept, policy._next["context", -1].tried) == (2, 3)
    policy.observe(matched=2, drafted=2, kept=0)  # no successor tried
    assert (policy._next["context", -1].kept, policy._next["context", -1].tried) == (2, 3)
    assert (policy._first["context", 2, False, -1].kept, policy._first["context", 2, False, -1].tried) == (2, 3)


def test_matches_whose_occurrences_agree_are_estimated_apart() -> None:
    policy = DraftPolicy(_costs(0.3))
    for _ in range(10):
        policy.observe(matched=2, drafted=1, kept=0, agreed=False)  # the latest of several continuations: wrong
        policy.observe(matched=2, drafted=1, kept=1, agreed=True)  # the only continuation the text has: right
    assert policy.count(2, 3, 0, agreed=False) == 0
    assert policy.count(2, 3, 0, agreed=True) >= 1


def test_a_new_request_starts_from_the_keep_rates_pooled_over_earlier_ones() -> None:
    costs, pooled = _costs(0.3), KeepRates()
    assert DraftPolicy(costs, pooled).count(1, 3, 0) >= 1  # nothing seen: the uniform prior drafts
    earlier = DraftPolicy(costs, pooled)
    for _ in range(20):
        earlier.observe(matched=1, drafted=1, kept=0)
    assert DraftPolicy(costs, pooled).count(1, 3, 0) == 0  # earlier requests never kept one
    assert DraftPolicy(costs).count(1, 3, 0) >= 1  # a policy pooling with no one starts from the prior
    own = DraftPolicy(costs, pooled)
    for _ in range(20):  # its own steps outweigh the pool
        own.observe(matched=1, drafted=1, kept=1)
    assert own.count(1, 3, 0) >= 1


def test_confidence_bins_cover_every_probability_and_unknown_is_apart() -> None:
    assert confidence_bin(None) == -1
    assert [confidence_bin(p) for p in (0.0, 0.3, 0.31, 0.7, 0.9, 0.95, 0.99, 1.0)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert len(FIRST_PRIOR) == len(SUCCESSOR_PRIOR) == len(CONFIDENCE_BINS) + 1
    assert all(0 < p < 1 for p in (*FIRST_PRIOR, *SUCCESSOR_PRIOR))
    assert FIRST_PRIOR[-1] > FIRST_PRIOR[0]  # a sure pick, a likelier copy (as measured on the tuning split)


def test_keep_rates_are_learned_apart_by_the_fed_tokens_confidence() -> None:
    policy = DraftPolicy(_costs(0.3))
    for _ in range(10):
        policy.observe(matched=1, drafted=3, kept=0, confidence=0.2)  # after an unsure pick: never kept
        policy.observe(matched=1, drafted=3, kept=3, confidence=0.99)  # after a sure one: every draft kept
    assert policy.count(1, 3, 0, confidence=0.1) == 0
    assert policy.count(1, 3, 0, confidence=0.97) == 3
    assert (policy._next["context", 3].kept, policy._next["context", 3].tried) == (20, 20)
    assert ("context", 1) not in policy._next  # a bin with no steps keeps its prior


def test_the_pooled_priors_by_confidence_start_a_new_request(monkeypatch: pytest.MonkeyPatch) -> None:
    pooled = KeepRates()
    assert pooled.first(("context", 1, False, 0)) == FIRST_PRIOR[0]
    assert pooled.first(("context", 1, False, 3)) == FIRST_PRIOR[3]
    assert pooled.successor(("phrases", 2)) == SUCCESSOR_PRIOR[2]
    assert pooled.first(("context", 1, False, -1)) == pooled.successor(("context", -1)) == 0.5  # unknown: uniform
    monkeypatch.setenv(CONFIDENCE_SWITCH, "0")  # switched off, every step pools in one bin, as before bins
    off = DraftPolicy(_costs(0.3))
    for _ in range(10):
        off.observe(matched=1, drafted=3, kept=0, confidence=0.2)
    off.observe(matched=1, drafted=3, kept=3, confidence=0.99)
    assert set(off._first) == {("context", 1, False, -1)}
    assert off.count(1, 3, 0, confidence=0.99) == 0


def test_top_probability_is_the_softmax_maximum() -> None:
    logits = torch.randn(1000) * 4
    assert top_probability(logits) == pytest.approx(float(logits.softmax(-1).max()), rel=1e-6)
    assert top_probability(torch.tensor([0.0, -1e4])) == pytest.approx(1.0)
