"""Recovery levers at serving time: splice adapter, APE calibration and query-aware selection, each against
an exact reference (full prefill, or the same mode without the lever)."""

from __future__ import annotations

import pytest
import torch

from pc_rag.calibration import Calibration
from pc_rag.errors import PCRagError
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.adapter import AdapterConfig, SpliceAdapter
from pc_rag.rag.modes import resolve_mode

TEXTS = [
    "The Eiffel Tower is in Paris and was finished in 1889.",
    "Mount Fuji is the highest mountain of Japan.",
    "The Danube flows through Vienna, Budapest and Belgrade before the Black Sea.",
]
QUESTION = "Which city has the tower?"


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max() / b.abs().max()) < 1e-4


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def engine(request, tokenizer) -> RagEngine:
    from conftest import tiny_model

    lm = tiny_model(request.param, tokenizer)
    adapter = SpliceAdapter(lm.model, AdapterConfig(rank=4), "tiny")
    with torch.no_grad():
        for p in adapter.lora_b.values():
            p.normal_(0, 0.3)
    return RagEngine(lm, RagPrompt.longbench(), adapter=adapter, calibration=Calibration(0.8, 1.2))


def test_levers_parse() -> None:
    mode = resolve_mode("query:0.05+adapter+ape")
    assert (mode.selection, mode.ratio, mode.adapter, mode.calibrated) == ("query", 0.05, True, True)
    assert resolve_mode("fast").adapter and not resolve_mode("prefix").adapter
    assert (resolve_mode("blend:0.2").selection, resolve_mode("blend:0.2").ratio) == ("blend", 0.2)
    question_only = resolve_mode("selective:0.2+adapter-question")
    assert question_only.adapter and question_only.adapter_skips_recomputed
    assert not resolve_mode("selective:0.2+adapter").adapter_skips_recomputed
    with pytest.raises(PCRagError, match=r"\+adapter"):
        resolve_mode("prefix+turbo")


@pytest.mark.parametrize("mode", ["selective:1.0+ape", "query:1.0", "query:1.0+ape", "blend:1.0"])
def test_recomputing_every_chunk_token_equals_full_prefill(engine, mode: str) -> None:
    chunks = engine.encode(TEXTS, "prefix")
    full = engine.answer_full(chunks, QUESTION, max_new_tokens=4, keep_logits=4)
    got = engine.answer(chunks, QUESTION, mode, max_new_tokens=4, reference_ids=full.token_ids[:3])
    assert got.token_ids == full.token_ids
    assert close(got.step_logits, full.step_logits[: got.step_logits.shape[0]])


def test_calibration_and_adapter_change_the_spliced_answer_only_when_asked(engine) -> None:
    chunks = engine.encode(TEXTS, "prefix")
    plain = engine.answer(chunks, QUESTION, "prefix", max_new_tokens=3, reference_ids=[5, 6])
    for mode in ("prefix+ape", "fast", "prefix+adapter+ape", "prefix+adapter-question"):
        other = engine.answer(chunks, QUESTION, mode, max_new_tokens=3, reference_ids=[5, 6])
        assert not close(other.step_logits, plain.step_logits), mode
    again = engine.answer(chunks, QUESTION, "prefix", max_new_tokens=3, reference_ids=[5, 6])
    assert torch.equal(again.step_logits, plain.step_logits)  # nothing stays switched on
    full = engine.answer_full(chunks, QUESTION, max_new_tokens=3, keep_logits=1)
    fresh = RagEngine(engine.lm, RagPrompt.longbench()).answer_full(chunks, QUESTION, max_new_tokens=3, keep_logits=1)
    assert torch.equal(full.step_logits, fresh.step_logits)  # full prefill never sees the levers


def test_a_mode_without_its_fitted_lever_says_how_to_get_it(tokenizer, monkeypatch, tmp_path) -> None:
    from conftest import tiny_model

    monkeypatch.setenv("PC_RAG_CACHE", str(tmp_path))
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())
    chunks = engine.encode(TEXTS[:1], "prefix")
    with pytest.raises(PCRagError, match="pc-rag tune"):
        engine.answer(chunks, QUESTION, "fast", max_new_tokens=1)


def test_blend_recomputes_the_largest_products_of_attention_and_deviation(engine, monkeypatch) -> None:
    from pc_rag.rag import engine as engine_module

    chunks = engine.encode(TEXTS, "prefix")
    seen: dict[str, torch.Tensor] = {}
    for name in ("question_attention", "kv_deviation"):
        real = getattr(engine_module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen[_name] = _real(*args, **kwargs)
            return seen[_name]

        monkeypatch.setattr(engine_module, name, spy)
    from pc_rag.runtime import executor

    chosen = []
    real_recompute = executor.recompute_and_prefill
    monkeypatch.setattr(
        executor, "recompute_and_prefill", lambda *a, **k: (chosen.extend(a[3]), real_recompute(*a, **k))[1]
    )
    engine.answer(chunks, QUESTION, "blend:0.25", max_new_tokens=1)
    head = len(engine.head_ids)
    product = seen["question_attention"][head:] * seen["kv_deviation"]
    expected = sorted((head + torch.topk(product, len(chosen)).indices).tolist())
    assert chosen == expected and 0 < len(chosen) < product.numel()
