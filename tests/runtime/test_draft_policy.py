"""The draft policy: the count of drafts with the most expected tokens per unit of measured step time."""

from __future__ import annotations

import pytest

from pc_rag.runtime.draft_policy import LENGTH_BUCKET, PRIOR_ROW_COST, WINDOW, DraftPolicy, KeepRates, StepCosts


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
    assert (policy._next["context"].kept, policy._next["context"].tried) == (0, 1)
    policy.observe(matched=2, drafted=3, kept=3)  # drafts 2 and 3 tried and kept
    assert (policy._next["context"].kept, policy._next["context"].tried) == (2, 3)
    policy.observe(matched=2, drafted=2, kept=0)  # no successor tried
    assert (policy._next["context"].kept, policy._next["context"].tried) == (2, 3)
    assert (policy._first["context", 2, False].kept, policy._first["context", 2, False].tried) == (2, 3)


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
