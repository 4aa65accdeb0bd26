"""Speculative decoding on SmolLM2: greedy answers with drafts from the passages are the answers of the same steps
without drafts, token for token, in the default mode (its merged adapter runs inside the fused step) and in
``naive``, and drafts are kept."""

from __future__ import annotations

import pytest

from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.model import LoadedModel
from pc_rag.rag import RagEngine
from pc_rag.runtime.speculation import PromptLookup

pytestmark = pytest.mark.real_model


@pytest.mark.parametrize("mode", ["default mode", "naive"])
def test_speculative_answers_are_the_plain_answers(smollm2: LoadedModel, mode: str, monkeypatch) -> None:
    engine = RagEngine(smollm2)
    mode = engine.default_mode if mode == "default mode" else mode
    accepted = 0
    for q in sample_questions()[:1]:  # one question keeps CI short; the benchmark covers more
        chunks = engine.encode([engine.passage_text(i + 1, t, x) for i, (t, x) in enumerate(q.passages[:3])], mode)
        with monkeypatch.context() as patch:  # the same steps with no drafts
            patch.setattr(PromptLookup, "propose", lambda self, count: [])
            plain = engine.answer(chunks, q.question, mode, max_new_tokens=32, speculative=True)
        fast = engine.answer(chunks, q.question, mode, max_new_tokens=32, speculative=True)
        assert fast.token_ids == plain.token_ids, q.id
        assert fast.stats.decode_steps < plain.stats.decode_steps
        accepted += fast.stats.accepted
    assert accepted > 0
