"""The splice adapter shipped for SmolLM2: it loads for the bundled model and brings answers toward full prefill
on questions outside the tuning split (the bundled sample is HotpotQA 0-39)."""

from __future__ import annotations

import pytest

from pc_rag.eval.metrics import teacher_forced
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.model import LoadedModel
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.modes import DEFAULT_MODE
from pc_rag.rag.tuned import PACKAGED, adapter_file

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def engine(smollm2: LoadedModel) -> RagEngine:
    return RagEngine(smollm2, RagPrompt.longbench())


def test_the_packaged_adapter_is_for_the_bundled_model(engine: RagEngine) -> None:
    assert (PACKAGED / adapter_file(engine.lm.fingerprint())).is_file()
    assert engine.tuned.adapter().fingerprint == engine.lm.fingerprint()


def test_the_bundled_model_gets_the_chosen_default_mode(engine: RagEngine) -> None:
    assert engine.default_mode == DEFAULT_MODE == "fast"


def test_fast_is_closer_to_full_prefill_than_plain_splicing(engine: RagEngine) -> None:
    """Mean 8-token teacher-forced KL(full || mode) over sample questions: the adapter must reduce it."""
    totals = {"prefix": 0.0, "fast": 0.0}
    for q in sample_questions()[:4]:
        texts = [engine.passage_text(i + 1, t, x) for i, (t, x) in enumerate(q.passages)]
        chunks = engine.encode(texts, "prefix")
        full = engine.answer_full(chunks, q.question, max_new_tokens=8, keep_logits=8)
        for mode in totals:
            result = engine.answer(chunks, q.question, mode, max_new_tokens=8, reference_ids=full.token_ids[:7])
            totals[mode] += teacher_forced(full, result)[0]
    assert totals["fast"] < 0.8 * totals["prefix"], totals


def test_int4_serves_the_adapter_of_the_float32_weights(smollm2: LoadedModel) -> None:
    """The int4 model is the bundled float32 model quantized: it finds the shipped adapter, so ``fast`` is its
    default too, and it brings answers toward the int4 model's own full prefill."""
    from pc_rag.model import load_model

    int4 = load_model(dtype="int4")
    assert int4.fitted_fingerprints() == (int4.fingerprint(), smollm2.fingerprint())
    engine = RagEngine(int4, RagPrompt.longbench())
    assert engine.default_mode == DEFAULT_MODE
    adapter = engine.tuned.adapter()
    assert adapter.fingerprint == smollm2.fingerprint()
    totals = {"prefix": 0.0, "fast": 0.0}
    for q in sample_questions()[:2]:
        chunks = engine.encode([engine.passage_text(i + 1, t, x) for i, (t, x) in enumerate(q.passages)], "prefix")
        full = engine.answer_full(chunks, q.question, max_new_tokens=8, keep_logits=8)
        for mode in totals:
            result = engine.answer(chunks, q.question, mode, max_new_tokens=8, reference_ids=full.token_ids[:7])
            totals[mode] += teacher_forced(full, result)[0]
    assert totals["fast"] < totals["prefix"], totals


def test_int4_finds_the_codec_tables_of_the_float32_weights(smollm2: LoadedModel) -> None:
    """A store made by the int4 model (the CLI's serving default) compresses with the shipped CacheGen tables."""
    from pc_rag.model import load_model
    from pc_rag.rag.tuned import find_codec_tables, find_tables
    from pc_rag.store.codec_setup import model_tables

    int4 = load_model(dtype="int4")
    shipped = find_codec_tables(smollm2.fingerprint())
    assert shipped is not None and find_codec_tables(int4.fingerprint()) is None
    assert find_tables(int4) == shipped == find_tables(smollm2)
    assert model_tables(int4.fitted_fingerprints())[1].fingerprint == smollm2.fingerprint()
