"""Comparison metrics against full prefill and their aggregation, checked against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pc_rag.eval.metrics import (
    TEACHER_FORCED_STEPS,
    QuestionRecord,
    aggregate,
    first_token_kl,
    make_record,
    paired_bootstrap_ci,
    percentile,
    teacher_forced,
    teacher_forced_steps,
)
from pc_rag.eval.report import format_table
from pc_rag.runtime.generate import GenerationResult, GenerationStats


def _result(
    text: str, ids: list[int], logits: list[float], ttft: float = 1.0, steps: list[list[float]] | None = None
) -> GenerationResult:
    stats = GenerationStats(ttft_ms=ttft, total_ms=2 * ttft, cached_tokens=0, computed_tokens=10, new_tokens=len(ids))
    step_logits = torch.tensor(steps) if steps is not None else None
    return GenerationResult(text, ids, stats, torch.tensor(logits), step_logits)


def test_kl_matches_hand_computation() -> None:
    p = torch.log(torch.tensor([0.5, 0.25, 0.25])) + 3.0  # logits: any shift gives the same softmax
    q = torch.log(torch.tensor([0.25, 0.25, 0.5])) - 1.0
    # KL(p || q) = 0.5 ln(0.5/0.25) + 0.25 ln 1 + 0.25 ln(0.25/0.5) = 0.25 ln 2
    assert first_token_kl(p, q) == pytest.approx(0.25 * math.log(2), abs=1e-7)
    assert first_token_kl(p, p) == 0.0
    assert first_token_kl(q, p) == pytest.approx(0.25 * math.log(2), abs=1e-7)


def test_kl_is_float64_on_a_large_vocabulary() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(49152, generator=gen) * 5, torch.randn(49152, generator=gen) * 5
    pa, pb = (np.exp(x - np.logaddexp.reduce(x)) for x in (a.double().numpy(), b.double().numpy()))
    expected = float(np.sum(pa * (np.log(pa) - np.log(pb))))
    assert first_token_kl(a, b) == pytest.approx(expected, rel=1e-9)
    assert first_token_kl(a, a + 1e-3) == pytest.approx(0.0, abs=1e-12)  # no float32 cancellation noise


def test_percentile_is_numpy_linear() -> None:
    values = [10.0, 1.0, 7.0, 3.0, 2.0, 9.0, 4.0]
    for q in (0.0, 0.5, 0.9, 1.0):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, 100 * q)))
    assert percentile(list(range(1, 11)), 0.9) == pytest.approx(9.1)


def test_record_compares_with_full() -> None:
    full = _result("The Tulsa", [5, 6], [0.0, 2.0, 1.0])
    same_text = _result(" The Tulsa\n", [5, 6, 7], [0.0, 2.0, 1.0])
    other = _result("Tulsa", [6], [0.0, 1.0, 2.0], ttft=0.5)
    kw = {
        "setting": "closed",
        "dataset": "d",
        "example_id": "1",
        "answers": ["Tulsa"],
        "context_tokens": 9,
        "full": full,
    }
    a = make_record(mode="a", result=same_text, **kw)
    assert (a.agreement, a.first_token_agreement, a.identical, a.first_token_kl) == (True, True, False, 0.0)
    assert a.f1 == 1.0 and a.full_starts_with_the
    b = make_record(mode="b", result=other, **kw)
    assert (b.agreement, b.first_token_agreement, b.identical, b.first_token_id) == (False, False, False, 6)
    assert b.first_token_kl > 0 and b.ttft_ms == 0.5 and b.context_tokens == 9
    eos_first = make_record(mode="c", result=_result("", [], [0.0, 0.0, 0.0]), **kw)
    assert eos_first.first_token_id is None and not eos_first.first_token_agreement
    assert not make_record(
        mode="d", result=full, **{**kw, "full": _result("Theodore", [1], [0, 0, 0])}
    ).full_starts_with_the


HALF, QUARTER = math.log(0.5), math.log(0.25)


def test_teacher_forced_metrics_match_hand_computation() -> None:
    # full answered [0, 1, 2] then EOS: four steps kept; the metrics cover the three answer tokens
    p = [[HALF, QUARTER, QUARTER], [QUARTER, HALF, QUARTER], [QUARTER, QUARTER, HALF], [0.0, 5.0, 0.0]]
    full = _result("abc", [0, 1, 2], p[0], steps=p)
    q = [p[0], [QUARTER - 1, HALF - 1, QUARTER - 1], [HALF, QUARTER, QUARTER]]  # same, same (shifted), other argmax
    mode = _result("abd", [0, 1, 0], q[0], steps=q)
    kl, agreement = teacher_forced(full, mode)
    # step 2: KL((.25,.25,.5) || (.5,.25,.25)) = .25 ln .5 + .5 ln 2 = .25 ln 2
    assert kl == pytest.approx(0.25 * math.log(2) / 3, abs=1e-9) and agreement == pytest.approx(2 / 3)
    assert teacher_forced(full, full) == (0.0, 1.0)
    record = make_record(setting="closed", dataset="d", example_id="1", mode="m", answers=["abc"],
                         context_tokens=1, result=mode, full=full)  # fmt: skip
    assert (record.teacher_forced_kl, record.teacher_forced_agreement) == (kl, agreement)
    no_steps = make_record(setting="closed", dataset="d", example_id="1", mode="m", answers=["abc"],
                           context_tokens=1, result=_result("abd", [0], q[0]), full=full)  # fmt: skip
    assert no_steps.teacher_forced_kl is None and no_steps.teacher_forced_agreement is None


def test_teacher_forced_steps_follow_full_answer_length() -> None:
    assert teacher_forced_steps(_result("", [], [0.0])) == 1  # EOS first: the first-token step only
    assert teacher_forced_steps(_result("x", [1, 2, 3], [0.0])) == 3
    assert teacher_forced_steps(_result("x", list(range(40)), [0.0])) == TEACHER_FORCED_STEPS == 8
    eos = _result("", [], [0.0, 3.0], steps=[[0.0, 3.0]])  # argmax 1 is EOS
    assert teacher_forced(eos, _result("", [], [0.0, 3.0], steps=[[1.0, 3.0]]))[1] == 1.0
    assert teacher_forced(eos, _result("x", [0], [3.0, 0.0], steps=[[3.0, 0.0]]))[1] == 0.0


def _rec(dataset: str, mode: str, i: int, f1: float, ttft: float, *, agree: bool, the: bool = False) -> QuestionRecord:
    return QuestionRecord(
        setting="closed", dataset=dataset, id=str(i), mode=mode, answer="x", f1=f1, ttft_ms=ttft,
        context_tokens=100 * (i + 1), first_token_id=1, agreement=agree, first_token_agreement=agree,
        first_token_kl=0.0 if agree else 0.2, identical=agree, full_starts_with_the=the,
        teacher_forced_kl=0.0 if agree else 0.4, teacher_forced_agreement=1.0 if agree else 0.5,
    )  # fmt: skip


def test_aggregate_rows_per_dataset_and_all() -> None:
    records = [
        _rec("hotpotqa", "full", 0, 1.0, 100, agree=True, the=True),
        _rec("hotpotqa", "full", 1, 0.5, 200, agree=True),
        _rec("musique", "full", 0, 0.0, 300, agree=True),
        _rec("hotpotqa", "naive", 0, 0.0, 10, agree=False, the=True),
        _rec("hotpotqa", "naive", 1, 0.5, 20, agree=True),
        _rec("musique", "naive", 0, 1.0, 30, agree=False),
    ]
    rows = aggregate(records, ["naive", "full"])
    assert [(r.dataset, r.mode, r.n) for r in rows] == [
        ("hotpotqa", "naive", 2), ("hotpotqa", "full", 2), ("musique", "naive", 1), ("musique", "full", 1),
        ("all", "naive", 3), ("all", "full", 3),
    ]  # fmt: skip
    hot_naive, all_naive, all_full = rows[0], rows[4], rows[5]
    assert hot_naive.f1 == pytest.approx(25.0) and hot_naive.agreement == 0.5
    assert hot_naive.first_token_agreement_non_the == 1.0  # the "The" question is left out
    assert hot_naive.first_token_kl == pytest.approx(0.1) and hot_naive.context_tokens_mean == 150
    assert all_naive.f1 == pytest.approx(100 * 1.5 / 3) and all_naive.agreement == pytest.approx(1 / 3)
    assert all_naive.first_token_agreement_non_the == 0.5 and all_naive.identical == pytest.approx(1 / 3)
    assert (all_naive.ttft_ms_median, all_naive.ttft_ms_p90) == (20, pytest.approx(28))
    assert (all_full.agreement, all_full.first_token_kl, all_full.setting) == (1.0, 0.0, "closed")
    assert [r.mode for r in aggregate(records, ["naive"])] == ["naive"] * 3  # unlisted modes are not reported
    only_the = aggregate([_rec("d", "m", 0, 1, 1, agree=True, the=True)])
    assert only_the[0].first_token_agreement_non_the is None


def test_f1_delta_is_paired_with_full_on_the_same_questions() -> None:
    records = [
        _rec("hotpotqa", "full", 0, 1.0, 100, agree=True),
        _rec("hotpotqa", "full", 1, 0.5, 200, agree=True),
        _rec("hotpotqa", "naive", 0, 0.0, 10, agree=False),
        _rec("hotpotqa", "naive", 1, 0.5, 20, agree=True),
    ]
    naive, full = aggregate(records, ["naive", "full"])[:2]
    assert naive.f1_delta == pytest.approx(-50.0)
    low, high = naive.f1_delta_ci95
    assert -100 <= low <= -50 <= high <= 0  # resampling the two deltas, -100 and 0
    assert full.f1_delta is None and full.f1_delta_ci95 is None
    unpaired = aggregate([*records, _rec("hotpotqa", "naive", 2, 1.0, 30, agree=True)], ["naive"])[0]
    assert unpaired.f1_delta is None and unpaired.f1_delta_ci95 is None  # question 2 has no full answer
    assert "-50.00 [" in format_table([naive, full])


def test_paired_bootstrap_ci_matches_the_normal_interval() -> None:
    assert paired_bootstrap_ci([2.5] * 30) == [2.5, 2.5]
    deltas = [1.0, -1.0] * 200  # mean 0, standard error 1 / sqrt(400) = 0.05
    low, high = paired_bootstrap_ci(deltas)
    assert low == pytest.approx(-1.96 * 0.05, abs=0.015) and high == pytest.approx(1.96 * 0.05, abs=0.015)
    assert paired_bootstrap_ci(deltas) == [low, high]  # seeded: the same interval every time


def test_paired_bootstrap_ci_does_not_depend_on_question_order() -> None:
    deltas = [float(i % 7) - 3.0 for i in range(50)]
    assert paired_bootstrap_ci(deltas) == paired_bootstrap_ci(list(reversed(deltas)))
    assert paired_bootstrap_ci(deltas) == paired_bootstrap_ci(sorted(deltas, key=lambda d: (d * 13) % 5))


def test_teacher_forced_rows_average_the_records_that_have_them() -> None:
    old = QuestionRecord(**{**vars(_rec("d", "m", 0, 1.0, 1, agree=True)), "teacher_forced_kl": None,
                            "teacher_forced_agreement": None})  # fmt: skip
    records = [old, _rec("d", "m", 1, 1.0, 1, agree=False), _rec("d", "m", 2, 1.0, 1, agree=True)]
    row = aggregate(records)[0]
    assert row.n == 3 and row.teacher_forced_kl == pytest.approx(0.2) and row.teacher_forced_agreement == 0.75
    only_old = aggregate([old])[0]
    assert only_old.teacher_forced_kl is None and only_old.teacher_forced_agreement is None
    header, old_line, line = format_table([only_old, row]).splitlines()
    assert header.split()[-8:-6] == ["tfKL", "tfAgr"]  # then "ttft p50", "ttft p90", "ctx tok"
    assert old_line.split()[-5:-3] == ["-", "-"] and line.split()[-5:-3] == ["0.2000", "0.750"]
