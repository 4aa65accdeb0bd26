"""Compute dtypes: quantized layers apply their weight on both paths, serving stays equal to a masked full
forward in every dtype, and fingerprints and stores keep dtypes apart."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from reference import reference_greedy, reference_last_logits
from test_document_store import embedder, make_store
from test_equivalence import PROMPTS, RICH

from pc_rag import weights
from pc_rag.cli import COMPUTE_DTYPE_NAMES
from pc_rag.engine import PromptCache
from pc_rag.errors import ModelLoadError, StoreMismatchError
from pc_rag.model import LoadedModel, load_model
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore
from pc_rag.weights import (
    COMPUTE_DTYPES,
    KERNEL_ROWS,
    Int4Linear,
    Int8Linear,
    apply_compute_dtype,
    compute_dtype,
)

QUANTIZED = ["int8", "int4"]


def tiny_in(arch: str, dtype: str, tokenizer) -> LoadedModel:
    lm = tiny_model(arch, tokenizer)
    compute = compute_dtype(dtype)
    apply_compute_dtype(lm.model, compute)
    return LoadedModel(model=lm.model, tokenizer=tokenizer, rope=lm.rope, name=lm.name, compute=compute)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).abs().max() / expected.float().abs().max())


@pytest.mark.parametrize("layer", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("rows", [1, 3, KERNEL_ROWS, 9])
def test_kernel_and_dense_paths_apply_the_same_weight(layer: type, rows: int) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 96, bias=True)
    quantized = layer.quantize(linear, torch.bfloat16)
    x = torch.randn(2, rows, 128, dtype=torch.bfloat16)
    dense = torch.nn.functional.linear(x.float(), quantized.weight.float(), quantized.bias.float())
    assert quantized(x).shape == (2, rows, 96)
    assert _relative_error(quantized(x), dense) < 2e-2  # bfloat16 products, different summation orders
    assert _relative_error(quantized.weight, linear.weight.detach()) < (0.02 if layer is Int8Linear else 0.15)


@pytest.mark.parametrize("native", [True, False])
def test_dense_bfloat16_runs_in_float32_where_the_cpu_has_no_bfloat16(monkeypatch, native: bool) -> None:
    """Without bfloat16 hardware a bfloat16 GEMM is emulated at a third of float32's speed: the dense path (many
    rows) then multiplies in float32 and rounds once, which differs from oneDNN's bfloat16 GEMM only in the
    order of its float32 sums."""
    monkeypatch.setattr(weights, "NATIVE_BFLOAT16", native)
    torch.manual_seed(0)
    quantized = Int4Linear.quantize(torch.nn.Linear(128, 96, bias=True), torch.bfloat16)
    x = torch.randn(1, 9, 128, dtype=torch.bfloat16)  # beyond KERNEL_ROWS: the dense path
    out = quantized(x)
    emulated = torch.nn.functional.linear(x, quantized.weight, quantized.bias)
    in_float32 = torch.nn.functional.linear(x.float(), quantized.weight.float(), quantized.bias.float()).bfloat16()
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, emulated if native else in_float32)
    torch.testing.assert_close(in_float32.float(), emulated.float(), rtol=2**-7, atol=1e-2)


def test_int4_recovers_weights_dequantized_from_q4_1_exactly() -> None:
    """Q4_1: per 32 inputs, w = d * q + m with q in 0..15; min-max requantization gets q, d and m back."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (64, 4, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 maps each block's min to 0 and max to 15
    d = torch.rand(64, 4, 1, generator=gen).half().float() * 0.01
    m = -torch.rand(64, 4, 1, generator=gen).half().float() * 0.05
    linear = torch.nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_((q * d + m).view(64, 128))
    exact = Int4Linear.quantize(linear, torch.float32)
    torch.testing.assert_close(exact.weight, linear.weight, rtol=0, atol=1e-7)
    rounded = Int4Linear.quantize(linear, torch.bfloat16)  # the CPU kernel's scales are bfloat16
    step = float(d.max())
    assert float((rounded.weight.float() - linear.weight.detach()).abs().max()) < 0.1 * step


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_every_linear_is_replaced_and_int4_keeps_the_output_at_8_bits(tokenizer, dtype: str) -> None:
    lm = tiny_in("llama", dtype, tokenizer)
    assert not any(type(m) is torch.nn.Linear for m in lm.model.modules())
    expected = Int8Linear if dtype == "int8" else Int4Linear
    assert isinstance(lm.model.model.layers[0].mlp.down_proj, expected)
    assert isinstance(lm.model.lm_head, Int8Linear)
    assert lm.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert (lm.dtype, lm.compute_dtype) == (torch.bfloat16, dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", *QUANTIZED])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("case", ["modules+param", "scaffold-joint"])
def test_serving_equals_a_masked_full_forward_in_each_dtype(tokenizer, dtype: str, arch: str, case: str) -> None:
    """The first token's logits and every decoded step (one row: the fused kernels) against the same model's
    masked full forward (many rows: the dense weights), at bfloat16 tolerance: the dense copy rounds each
    dequantized weight to bfloat16 once more, and the tiny models' widened weights amplify it over steps."""
    pc = PromptCache(tiny_in(arch, dtype, tokenizer))
    pc.add_schema(RICH)
    prompt = PROMPTS[case]
    result = pc.generate(prompt, max_new_tokens=4, keep_logits=4)
    assert result.first_logits.dtype == torch.float32
    assert _relative_error(result.first_logits, reference_last_logits(pc, prompt)) < 3e-2
    tokens, logits = reference_greedy(pc, prompt, len(result.token_ids))
    assert len(tokens) > 1
    for step, (actual, expected) in enumerate(zip(result.step_logits, logits, strict=True)):
        assert _relative_error(actual, expected) < 6e-2, f"step {step}"
        if result.token_ids[step] != tokens[step]:  # a near-tie flipped by rounding: the contexts part here
            break


def test_fingerprints_keep_dtypes_apart_and_float32_unchanged(tokenizer) -> None:
    dense = tiny_model("llama", tokenizer)
    declared = LoadedModel(dense.model, tokenizer, dense.rope, dense.name, compute=compute_dtype("float32"))
    assert declared.fingerprint() == dense.fingerprint()  # stores and tuned files made before stay valid
    prints = {dtype: tiny_in("llama", dtype, tokenizer).fingerprint() for dtype in COMPUTE_DTYPES}
    assert prints["float32"] == dense.fingerprint()
    assert len(set(prints.values())) == len(COMPUTE_DTYPES)


def test_a_store_refuses_kv_made_in_another_compute_dtype(tmp_path, tokenizer) -> None:
    make_store(tmp_path, RagEngine(tiny_model("llama", tokenizer), RagPrompt()))
    other = RagEngine(tiny_in("llama", "int4", tokenizer), RagPrompt())
    with pytest.raises(StoreMismatchError, match=r"model_dtype.*float32/float32.*int4/float32"):
        DocumentStore.load(tmp_path / "store", other, embedder=embedder())


def test_a_store_built_in_int4_answers_in_int4(tmp_path, tokenizer) -> None:
    engine = RagEngine(tiny_in("llama", "int4", tokenizer), RagPrompt())
    store = make_store(tmp_path, engine)
    assert store.manifest.identity.model_dtype == "int4/bfloat16"  # KV stored as the model computes it
    loaded = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())
    answer = PromptServer(store=loaded).answer("How tall?", k=2)
    assert answer.result.token_ids


def test_unknown_dtypes_are_refused_before_anything_loads() -> None:
    with pytest.raises(ModelLoadError, match=r"unknown compute dtype 'int3'.*float32, bfloat16, int8, int4"):
        load_model("/nonexistent/model", dtype="int3")
    assert compute_dtype(torch.bfloat16) is COMPUTE_DTYPES["bfloat16"]
    assert tuple(COMPUTE_DTYPES) == COMPUTE_DTYPE_NAMES  # the CLI's list, kept without importing torch
