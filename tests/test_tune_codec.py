"""``pc-rag tune-codec``: tables fitted on the tuning split only, usable by the codec, refused without passages."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_model

from pc_rag.codec import CacheGenCodec
from pc_rag.errors import PCRagError
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.modes import MODES
from pc_rag.tune.codec import DEPTH_STEPS, PROBE_LAYERS_STEP, allocation, fit_codec


def _dataset(path, examples: int) -> None:
    rows = [
        {"id": f"q{i}", "question": "Who?", "answers": ["x"],
         "passages": [{"title": f"T{i}-{j}", "text": f"passage {i} {j} " * (5 + j)} for j in range(3)]}
        for i in range(examples)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_tables_are_fitted_on_tuning_passages_and_serve_the_codec(tmp_path, tokenizer) -> None:
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())
    _dataset(tmp_path / "hotpotqa.jsonl", 302)  # questions 300 and 301 are the tuning split's
    tables = fit_codec(engine, tmp_path / "hotpotqa.jsonl", passages=5, progress=False)
    assert tables.fingerprint == engine.lm.fingerprint()
    (chunk,) = engine.encode(["Passage 1:\nT\nsomething else entirely, not in the sample"], "naive")
    out = CacheGenCodec(tables).decode(CacheGenCodec(tables).encode(chunk.kv, 4))
    assert float((out.keys - chunk.kv.keys).abs().mean()) < 0.2 * float(chunk.kv.keys.abs().mean())
    assert torch.equal(out.positions, chunk.kv.positions)
    layers = chunk.kv.keys.shape[0]
    assert torch.equal(tables.transform.allocation, allocation(layers))


@pytest.mark.parametrize("layers", [2, 18, 30])
def test_the_allocation_spends_steps_by_depth_and_refines_the_probe_layers(layers: int) -> None:
    probe = MODES["default"].probe_layer
    out = allocation(layers)
    assert out.shape == (2, layers) and torch.equal(out[0], out[1])
    assert bool((out[:, : probe + 1] == PROBE_LAYERS_STEP).all())
    assert set(out[0, probe + 1 :].tolist()) <= set(torch.tensor(DEPTH_STEPS).tolist())
    if layers >= len(DEPTH_STEPS):
        assert float(out[0, -1]) == DEPTH_STEPS[-1]


def test_no_tuning_passages_is_a_clear_error(tmp_path, tokenizer) -> None:
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())
    _dataset(tmp_path / "hotpotqa.jsonl", 10)
    with pytest.raises(PCRagError, match="no passages of the tuning split"):
        fit_codec(engine, tmp_path / "hotpotqa.jsonl", progress=False)
