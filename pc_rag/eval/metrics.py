"""Per-question evaluation records, their comparison with full prefill, and aggregation into result rows.

Every mode is compared with the full prefill of the same example: answer agreement, first-token
agreement and KL(full || mode) of the first-token distributions, and the same two teacher-forced
over the first ``TEACHER_FORCED_STEPS`` tokens of full's greedy answer r: step j compares full's
next-token distribution given prompt + r[:j] with the mode's given its own cached prompt + r[:j].
This module knows nothing about engines or files; the runner builds the records, the report prints
and plots the rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pc_rag.eval.longbench import best_f1
from pc_rag.runtime.generate import GenerationResult

ALL = "all"  # the dataset name of the rows that pool every dataset
FULL = "full"  # full prefill of the same tokens: the reference every mode is compared with
BOOTSTRAP_ROUNDS = 2000
TEACHER_FORCED_STEPS = 8  # answer tokens of full prefill the teacher-forced metrics average over
_STARTS_WITH_THE = re.compile(r"\s*The\b")


@dataclass
class QuestionRecord:
    """One answered question in one mode; comparison fields are against full prefill (full vs itself for full)."""

    setting: str
    dataset: str
    id: str
    mode: str
    answer: str
    f1: float  # best qa_f1_score over the gold answers, in [0, 1]
    ttft_ms: float
    context_tokens: int  # tokens of the passages (the chunks), the same in every mode
    first_token_id: int | None  # None when the first step produced EOS
    agreement: bool  # answer.strip() == full's answer.strip()
    first_token_agreement: bool
    first_token_kl: float  # KL(full || mode) of the first-token distributions, in nats
    identical: bool  # the generated token ids equal full's
    full_starts_with_the: bool  # full's answer starts with the word "The"
    retrieval_recall: float | None = None  # open retrieval: share of supporting passages retrieved
    # mean over teacher-forced steps (module docstring); None in records of runs made before they existed
    teacher_forced_kl: float | None = None  # KL(full || mode) in nats
    teacher_forced_agreement: float | None = None  # share of steps whose argmax is full's token
    # modes over stored chunks only (<mode>@cachegen:<level>, <mode>@<dtype>): against <mode> on chunks as encoded
    codec_kl: float | None = None  # KL(as encoded || stored) of the first-token distributions, in nats
    codec_agreement: bool | None = None  # the first token is the mode's on chunks as encoded


@dataclass
class ResultRow:
    """Aggregate of one (dataset, mode): shares in [0, 1], F1 times 100 as LongBench reports it."""

    dataset: str
    mode: str
    setting: str
    n: int
    f1: float
    agreement: float
    first_token_agreement: float
    first_token_kl: float
    ttft_ms_median: float
    ttft_ms_p90: float
    context_tokens_mean: float
    first_token_agreement_non_the: float | None  # None when every full answer starts with "The"
    identical: float
    retrieval_recall: float | None = None  # open retrieval only: mean share of supporting passages retrieved
    f1_delta: float | None = None  # F1 minus full prefill's on the same questions (None for full itself)
    f1_delta_ci95: list[float] | None = None  # paired bootstrap 95% interval of f1_delta
    teacher_forced_kl: float | None = None  # mean over the records that have it (None if none does)
    teacher_forced_agreement: float | None = None
    codec_kl: float | None = None  # stored-chunk modes: mean first-token KL(as encoded || stored)
    codec_agreement: float | None = None
    codec_f1_delta: float | None = None  # F1 minus the same mode's on chunks as encoded, same questions
    codec_f1_delta_ci95: list[float] | None = None


def first_token_kl(full_logits: torch.Tensor, mode_logits: torch.Tensor) -> float:
    """KL(p_full || p_mode) in nats of the softmax of two first-step logit vectors [V], computed in float64."""
    assert full_logits.shape == mode_logits.shape, (full_logits.shape, mode_logits.shape)
    log_p = torch.log_softmax(full_logits.detach().cpu().double(), dim=-1)
    log_q = torch.log_softmax(mode_logits.detach().cpu().double(), dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))  # 0 * log 0 = 0
    return float(terms.sum())


def teacher_forced_steps(full: GenerationResult) -> int:
    """Steps the teacher-forced metrics cover: full's answer tokens up to ``TEACHER_FORCED_STEPS``, at least one.

    A mode is forced with the tokens of all but the last step: ``full.token_ids[:steps - 1]``.
    """
    return max(1, min(TEACHER_FORCED_STEPS, len(full.token_ids)))


def teacher_forced(full: GenerationResult, result: GenerationResult) -> tuple[float, float] | None:
    """(mean KL(p_j || q_j) in nats, share of steps with argmax q_j == argmax p_j) over the forced steps.

    p_j are full's ``step_logits`` (its own greedy steps, so argmax p_j is its token j, or EOS), q_j the
    mode's forced with full's tokens. None when either result lacks them.
    """
    if full.step_logits is None or result.step_logits is None:
        return None
    steps = teacher_forced_steps(full)
    p, q = full.step_logits[:steps], result.step_logits[:steps]
    assert p.shape == q.shape and len(p) == steps, (p.shape, q.shape, steps)
    kl = math.fsum(first_token_kl(p[j], q[j]) for j in range(steps)) / steps
    agreement = float((p.argmax(-1) == q.argmax(-1)).double().mean())
    return kl, agreement


def make_record(
    *,
    setting: str,
    dataset: str,
    example_id: str,
    mode: str,
    answers: Sequence[str],
    context_tokens: int,
    result: GenerationResult,
    full: GenerationResult,
    retrieval_recall: float | None = None,
    plain_first_logits: torch.Tensor | None = None,
) -> QuestionRecord:
    """Score ``result`` against the gold ``answers`` and compare it with the ``full`` prefill's result (and with
    ``plain_first_logits``, the same mode's on uncompressed chunks, when given)."""
    first = result.token_ids[0] if result.token_ids else None
    full_first = full.token_ids[0] if full.token_ids else None
    forced = teacher_forced(full, result)
    return QuestionRecord(
        setting=setting,
        dataset=dataset,
        id=example_id,
        mode=mode,
        answer=result.text,
        f1=best_f1(result.text, answers),
        ttft_ms=result.stats.ttft_ms,
        context_tokens=context_tokens,
        first_token_id=first,
        agreement=result.text.strip() == full.text.strip(),
        first_token_agreement=first == full_first,
        first_token_kl=first_token_kl(full.first_logits, result.first_logits),
        identical=list(result.token_ids) == list(full.token_ids),
        full_starts_with_the=bool(_STARTS_WITH_THE.match(full.text)),
        retrieval_recall=retrieval_recall,
        teacher_forced_kl=forced[0] if forced else None,
        teacher_forced_agreement=forced[1] if forced else None,
        codec_kl=None if plain_first_logits is None else first_token_kl(plain_first_logits, result.first_logits),
        codec_agreement=None
        if plain_first_logits is None
        else _argmax(plain_first_logits) == _argmax(result.first_logits),
    )


def _argmax(logits: torch.Tensor) -> int:
    return int(logits.argmax())


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) with linear interpolation between order statistics (numpy's default)."""
    assert values and 0 <= q <= 1, (len(values), q)
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def aggregate(records: Iterable[QuestionRecord], modes: Sequence[str] | None = None) -> list[ResultRow]:
    """One row per (setting, dataset, mode) plus an ``"all"`` row per setting and mode pooling every question.

    Rows are grouped by setting, then dataset (in first-seen order, ``"all"`` last), then mode in
    ``modes`` order (default: first-seen order); records of other modes are ignored.
    """
    records = list(records)
    full_f1 = {(r.setting, r.dataset, r.id): r.f1 for r in records if r.mode == FULL}
    mode_f1 = {(r.setting, r.dataset, r.id, r.mode): r.f1 for r in records}
    if modes is None:
        modes = list(dict.fromkeys(r.mode for r in records))
    rows = []
    for setting in dict.fromkeys(r.setting for r in records):
        in_setting = [r for r in records if r.setting == setting]
        datasets = list(dict.fromkeys(r.dataset for r in in_setting))
        for dataset in [*datasets, ALL]:
            for mode in modes:
                group = [r for r in in_setting if r.mode == mode and dataset in (ALL, r.dataset)]
                if group:
                    rows.append(_row(dataset, mode, group, full_f1, mode_f1))
    return rows


def _row(
    dataset: str, mode: str, group: list[QuestionRecord], full_f1: dict[tuple[str, str, str], float],
    mode_f1: dict[tuple[str, str, str, str], float],
) -> ResultRow:  # fmt: skip
    deltas = _f1_deltas(mode, group, full_f1)
    codec_kl = [r.codec_kl for r in group if r.codec_kl is not None]
    codec_deltas = _codec_f1_deltas(group, mode_f1)
    non_the = [r.first_token_agreement for r in group if not r.full_starts_with_the]
    recalls = [r.retrieval_recall for r in group if r.retrieval_recall is not None]
    forced_kl = [r.teacher_forced_kl for r in group if r.teacher_forced_kl is not None]
    forced_agreement = [r.teacher_forced_agreement for r in group if r.teacher_forced_agreement is not None]
    ttfts = [r.ttft_ms for r in group]
    settings = {r.setting for r in group}
    assert len(settings) == 1, f"one row mixes settings {settings}"
    return ResultRow(
        dataset=dataset,
        mode=mode,
        setting=settings.pop(),
        n=len(group),
        f1=100 * _mean(r.f1 for r in group),
        agreement=_mean(r.agreement for r in group),
        first_token_agreement=_mean(r.first_token_agreement for r in group),
        first_token_kl=_mean(r.first_token_kl for r in group),
        ttft_ms_median=percentile(ttfts, 0.5),
        ttft_ms_p90=percentile(ttfts, 0.9),
        context_tokens_mean=_mean(r.context_tokens for r in group),
        first_token_agreement_non_the=_mean(non_the) if non_the else None,
        identical=_mean(r.identical for r in group),
        retrieval_recall=_mean(recalls) if recalls else None,
        f1_delta=_mean(deltas) if deltas else None,
        f1_delta_ci95=paired_bootstrap_ci(deltas) if deltas else None,
        teacher_forced_kl=_mean(forced_kl) if forced_kl else None,
        teacher_forced_agreement=_mean(forced_agreement) if forced_agreement else None,
        codec_kl=_mean(codec_kl) if codec_kl else None,
        codec_agreement=_mean(r.codec_agreement for r in group if r.codec_agreement is not None) if codec_kl else None,
        codec_f1_delta=_mean(codec_deltas) if codec_deltas else None,
        codec_f1_delta_ci95=paired_bootstrap_ci(codec_deltas) if codec_deltas else None,
    )


def _codec_f1_deltas(group: list[QuestionRecord], mode_f1: dict[tuple[str, str, str, str], float]) -> list[float]:
    """Per-question F1 change (x100) of a stored-chunk mode (``<mode>@...``) against ``<mode>``, where both ran."""
    out = []
    for r in group:
        base, sep, _ = r.mode.partition("@")
        plain = mode_f1.get((r.setting, r.dataset, r.id, base)) if sep else None
        if plain is not None:
            out.append(100 * (r.f1 - plain))
    return out


def _f1_deltas(
    mode: str, group: list[QuestionRecord], full_f1: dict[tuple[str, str, str], float]
) -> list[float] | None:
    """Per-question F1 change against full prefill (x100); None for full itself or when a question lacks full's."""
    if mode == FULL:
        return None
    full = [full_f1.get((r.setting, r.dataset, r.id)) for r in group]
    if None in full:
        return None
    return [100 * (r.f1 - f) for r, f in zip(group, full, strict=True)]


def paired_bootstrap_ci(deltas: Sequence[float], rounds: int = BOOTSTRAP_ROUNDS, seed: int = 0) -> list[float]:
    """The 95% percentile interval of the mean of per-question differences, resampling questions (seeded).

    The differences are sorted first, so the interval does not depend on the order the questions come in.
    """
    values = torch.tensor(sorted(deltas), dtype=torch.float64)
    picks = torch.randint(len(values), (rounds, len(values)), generator=torch.Generator().manual_seed(seed))
    means = values[picks].mean(dim=1).tolist()
    return [percentile(means, 0.025), percentile(means, 0.975)]


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return math.fsum(values) / len(values)
