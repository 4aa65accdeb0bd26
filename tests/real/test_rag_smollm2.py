"""RAG assembly on SmolLM2: exact when everything is recomputed, and recovery brings the answer toward full prefill."""

from __future__ import annotations

import pytest
import torch

from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.model import LoadedModel
from pc_rag.rag import RagEngine, RagPrompt, RecoveryMode

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def engine(smollm2: LoadedModel) -> RagEngine:
    return RagEngine(smollm2, RagPrompt.longbench())


def kl(full: torch.Tensor, other: torch.Tensor) -> float:
    p, q = full.double().log_softmax(-1), other.double().log_softmax(-1)
    return float((p.exp() * (p - q)).sum())


def test_full_recompute_equals_full_prefill(engine: RagEngine) -> None:
    q = sample_questions()[0]
    texts = [engine.passage_text(i + 1, t, x) for i, (t, x) in enumerate(q.passages[:4])]
    mode = RecoveryMode("all", ratio=1.0)
    recovered = engine.answer(engine.encode(texts, mode), q.question, mode, max_new_tokens=8)
    full = engine.answer_full(engine.encode(texts, mode), q.question, max_new_tokens=8)
    assert float((recovered.first_logits - full.first_logits).abs().max() / full.first_logits.abs().max()) < 1e-4
    assert recovered.text == full.text


def test_selective_recovery_beats_naive_splice(engine: RagEngine) -> None:
    """Mean first-token KL(full || mode) over a few sample questions: recovery must reduce it."""
    totals = {"naive": 0.0, "selective": 0.0}
    for q in sample_questions()[:3]:
        texts = [engine.passage_text(i + 1, t, x) for i, (t, x) in enumerate(q.passages[:6])]
        full = engine.answer_full(engine.encode(texts, "naive"), q.question, max_new_tokens=1).first_logits
        for mode in totals:
            result = engine.answer(engine.encode(texts, mode), q.question, mode, max_new_tokens=1)
            totals[mode] += kl(full, result.first_logits)
    assert totals["selective"] < totals["naive"]
