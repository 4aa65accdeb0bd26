"""Self-distillation pieces: teacher records, the top-k KL, the student path, and a training run that helps."""

from __future__ import annotations

import pytest
import torch

from pc_rag.errors import PCRagError
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.adapter import AdapterConfig
from pc_rag.tune.pairs import Pair
from pc_rag.tune.teacher import TeacherSet, teach
from pc_rag.tune.train import TrainConfig, student_logprobs, topk_kl, train_adapter

TEXTS = [
    "The Eiffel Tower is in Paris and was finished in 1889.",
    "Mount Fuji is the highest mountain of Japan.",
    "The Danube flows through Vienna, Budapest and Belgrade before the Black Sea.",
    "Gustave Eiffel's company also built the frame of the Statue of Liberty.",
]
QUESTIONS = ["Which city has the tower?", "What is the highest mountain?", "Where does the Danube end?"]


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    from conftest import tiny_model

    return RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())


@pytest.fixture(scope="module")
def chunks(engine):
    return engine.encode(TEXTS, "prefix")


def test_teacher_is_full_prefill(engine, chunks) -> None:
    record = teach(engine, chunks, QUESTIONS[0], "k", steps=4, top=16)
    full = engine.answer_full(chunks, QUESTIONS[0], max_new_tokens=3)
    assert list(record.answer_ids) == full.token_ids[: record.steps - 1]
    expected = torch.log_softmax(full.first_logits, -1)[record.index[0]]
    assert torch.allclose(record.logp[0], expected, atol=1e-5)
    assert record.index.shape == record.logp.shape == (record.steps, 16)


def test_topk_kl_is_exact_with_the_whole_vocabulary_and_a_lower_bound_otherwise() -> None:
    torch.manual_seed(0)
    p, q = torch.log_softmax(torch.randn(3, 50), -1), torch.log_softmax(torch.randn(3, 50), -1)
    exact = (p.exp() * (p - q)).sum(-1)
    whole = torch.sort(p, descending=True)
    assert torch.allclose(topk_kl(whole.values, whole.indices, q), exact, atol=1e-5)
    top = torch.topk(p, 5)
    bound = topk_kl(top.values, top.indices, q)
    assert bool((bound <= exact + 1e-6).all()) and bool((bound >= 0).all())


def test_student_without_adapter_is_the_prefix_serving_path(engine, chunks) -> None:
    record = teach(engine, chunks, QUESTIONS[0], "k", steps=3, top=8)
    served = engine.answer(chunks, QUESTIONS[0], "prefix", max_new_tokens=1)
    logp = student_logprobs(engine, None, chunks, QUESTIONS[0], record)
    assert logp.shape[0] == record.steps
    assert torch.allclose(logp[0], torch.log_softmax(served.first_logits, -1), atol=1e-4)


@pytest.mark.parametrize("share", [0.3, 1.0])
def test_recomputing_student_is_the_selective_serving_path(engine, chunks, share: float) -> None:
    record = teach(engine, chunks, QUESTIONS[0], "k", steps=3, top=8)
    served = engine.answer(chunks, QUESTIONS[0], f"selective:{share}", max_new_tokens=1)
    logp = student_logprobs(engine, None, chunks, QUESTIONS[0], record, recompute=share)
    assert torch.allclose(logp[0], torch.log_softmax(served.first_logits, -1), atol=1e-4)
    if share == 1.0:  # every chunk token recomputed: the teacher's own distributions, at every step
        full = torch.log_softmax(
            engine.answer_full(chunks, QUESTIONS[0], max_new_tokens=3, keep_logits=3).step_logits, -1
        )
        assert torch.allclose(logp.gather(-1, record.index), full[: record.steps].gather(-1, record.index), atol=1e-4)


def test_teacher_set_resumes_and_refuses_unknown_keys(engine, chunks, tmp_path) -> None:
    records = [teach(engine, chunks, q, f"ex{i}/closed", steps=3, top=8) for i, q in enumerate(QUESTIONS)]
    teacher = TeacherSet(tmp_path)
    teacher.add_many(records[:2])
    with (tmp_path / "teacher.jsonl").open("a") as f:
        f.write('{"key": "cut')  # a crash in the middle of a line
    reopened = TeacherSet(tmp_path)
    assert sorted(reopened.keys()) == ["ex0/closed", "ex1/closed"]
    got = reopened.get("ex1/closed")
    assert got.answer_ids == records[1].answer_ids and torch.equal(got.logp, records[1].logp)
    with pytest.raises(PCRagError, match="no teacher record"):
        reopened.get("ex2/closed")


def test_training_lowers_kl_to_full_prefill(engine, chunks) -> None:
    orders = [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2]]
    pairs, records = [], {}
    for i, question in enumerate(QUESTIONS):
        for j, order in enumerate(orders):
            key = f"{i}/{j}"
            pairs.append(Pair(key, "train", "closed", tuple(map(str, order)), question))
            records[key] = teach(engine, [chunks[o] for o in order], question, key, steps=4, top=64)
    by_id = {str(i): c for i, c in enumerate(chunks)}
    config = TrainConfig(epochs=6, lr=5e-3, accumulate=3, eval_every=9, patience=10, recompute=(0.0, 0.2))
    adapter, report = train_adapter(
        engine, pairs, pairs, lambda p: [by_id[d] for d in p.doc_ids], records.__getitem__,
        AdapterConfig(rank=4), config, progress=False,
    )  # fmt: skip
    baseline = report.history[0]
    assert report.best is not None and report.best.mean_kl < 0.5 * baseline.mean_kl, report.history
    assert not adapter._hooks and not any(p.requires_grad for p in adapter.parameters())
    assert all(p.requires_grad for p in engine.lm.model.parameters())  # the shared model is left as it was


def test_recompute_shares_are_parsed_or_refused() -> None:
    from pc_rag.tune.cli import _shares

    assert _shares("0,0.1,0.2") == (0.0, 0.1, 0.2)
    for bad in ("", "0,x", "1.5", "-0.1"):
        with pytest.raises(PCRagError, match="--recompute"):
            _shares(bad)
