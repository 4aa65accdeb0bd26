"""The fused decode step equals the model's own forward, token after token, and is used only where it can be."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from conftest import TINY_CONFIGS, acting_adapter, tiny_model
from test_weights import tiny_in

from pc_rag.assemble import forward_new_tokens
from pc_rag.engine import PromptCache
from pc_rag.kv import allocate
from pc_rag.pml.nodes import Import, Module, Prompt, Schema, Text
from pc_rag.runtime.cpu_kernels import DOT_SWITCH
from pc_rag.runtime.decode_step import DecodeStep, kernel_corrections
from pc_rag.runtime.generate import SamplingParams, decode_tokens
from pc_rag.runtime.model_call import ModelCall

DESCRIBED = ["llama", "llama3-scaled", "mistral", "qwen2", "qwen3"]
# bf16 attention rounds twice here (the flash pass over the cache, then the merge with the new key) where SDPA
# over all keys rounds once: a last-bit difference that later layers carry along
TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2, "int8": 5e-2, "int4": 5e-2}


@pytest.mark.parametrize("dtype", sorted(TOLERANCE))
@pytest.mark.parametrize("arch", DESCRIBED)
def test_each_step_equals_the_forward_and_writes_the_same_cache(
    tokenizer, decode_attention_path, arch: str, dtype: str
) -> None:
    lm = tiny_in(arch, dtype, tokenizer)
    step = DecodeStep.of(lm.model)
    assert step is not None
    prompt = tokenizer("The tower stands in Paris and is tall.", add_special_tokens=False)["input_ids"]
    ours, theirs = allocate(lm.model, len(prompt) + 8), allocate(lm.model, len(prompt) + 8)
    ours_cache, theirs_cache = ours.cache(0), theirs.cache(0)
    with torch.inference_mode():
        lm.model(input_ids=torch.tensor([prompt]), cache=ours_cache, use_cache=True)
        lm.model(input_ids=torch.tensor([prompt]), cache=theirs_cache, use_cache=True)
        for position, token in enumerate([5, 77, 301, 9], start=len(prompt)):
            fused = step([token], position, ours_cache)[0]
            plain = lm.model(
                input_ids=torch.tensor([[token]]),
                position_ids=torch.tensor([[position]]),
                cache=theirs_cache,
                use_cache=True,
            ).logits[0, -1]
            error = (fused.float() - plain.float()).abs().max() / plain.float().abs().max()
            assert error < TOLERANCE[dtype], f"position {position}: relative error {error:.1e}"
    length = len(prompt) + 4
    assert ours_cache.get_seq_length() == theirs_cache.get_seq_length() == length
    torch.testing.assert_close(ours.keys[:, :, :, :length], theirs.keys[:, :, :, :length], **_close(dtype))
    torch.testing.assert_close(ours.values[:, :, :, :length], theirs.values[:, :, :, :length], **_close(dtype))


def _close(dtype: str) -> dict[str, float]:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == "float32" else {"rtol": 5e-2, "atol": 1e-1}


@pytest.mark.parametrize("arch", sorted(set(TINY_CONFIGS) - set(DESCRIBED)))
def test_models_it_does_not_describe_decode_through_their_forward(tokenizer, arch: str) -> None:
    assert DecodeStep.of(tiny_model(arch, tokenizer).model) is None


def test_plain_calls_decode_through_the_step_and_others_through_the_forward(tokenizer, monkeypatch) -> None:
    pc = PromptCache(tiny_model("llama", tokenizer))
    pc.add_schema(Schema("s", (Module("doc", (Text("The tower is in Paris."),)),)))
    prompt = Prompt("s", (Import("doc"), Text(" Where is it?")))
    steps: list[int] = []
    original = DecodeStep.__call__

    def counting(
        self: DecodeStep, tokens: list[int], position: int, cache: object, rows: int = 1, bucketed: bool = False
    ) -> torch.Tensor:
        steps.append(position)
        return original(self, tokens, position, cache, rows, bucketed)

    monkeypatch.setattr(DecodeStep, "__call__", counting)
    fused = pc.generate(prompt, max_new_tokens=5, keep_logits=5)
    assert len(steps) == len(fused.token_ids) - 1 > 0
    entered: list[int] = []

    @contextmanager
    def counted() -> Iterator[None]:  # a context around each call (an adapter applied)
        entered.append(1)
        yield

    # a context acts through the linear modules; the step calls a module wherever something acts on it
    for lm, through_step in ((pc.lm, True), (tiny_in("llama", "int8", tokenizer), True)):
        steps.clear()
        entered.clear()
        buffer = allocate(lm.model, 32)
        logits, cache = forward_new_tokens(lm.model, buffer, 0, [1, 2, 3], range(3))
        params = SamplingParams(max_new_tokens=4, speculative=False)
        tokens = list(decode_tokens(lm.model, cache, logits, 3, params, frozenset(), ModelCall(context=counted)))
        assert len(entered) == len(tokens) - 1 > 0
        assert len(steps) == (len(tokens) - 1 if through_step else 0)


@pytest.mark.parametrize("merged", [True, False])
def test_an_adapter_on_quantized_layers_acts_inside_the_step(tokenizer, merged: bool) -> None:
    """The fused q/k/v kernel would bypass an adapter on ``q_proj``: where one is attached the step runs those
    layers as modules, so it equals the model's forward with the adapter applied, and differs from it without."""
    lm = tiny_in("llama", "int4", tokenizer)
    adapter = acting_adapter(lm.model)
    adapter.attach(merged=merged)
    step = DecodeStep.of(lm.model)
    assert step is not None
    prompt = tokenizer("The tower stands in Paris and is tall.", add_special_tokens=False)["input_ids"]
    buffers = [allocate(lm.model, len(prompt) + 8) for _ in range(3)]
    caches = [b.cache(0) for b in buffers]
    try:
        with torch.inference_mode():
            for cache in caches:
                lm.model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
            for position, token in enumerate([5, 77, 301], start=len(prompt)):
                inputs = {"input_ids": torch.tensor([[token]]), "position_ids": torch.tensor([[position]])}
                with adapter.applied():
                    fused = step([token], position, caches[0])[0].float()
                    adapted = lm.model(**inputs, cache=caches[1], use_cache=True).logits[0, -1].float()
                plain = lm.model(**inputs, cache=caches[2], use_cache=True).logits[0, -1].float()
                scale = adapted.abs().max()
                assert (fused - adapted).abs().max() / scale < TOLERANCE["int4"]
                assert (fused - plain).abs().max() / scale > 5 * TOLERANCE["int4"]
    finally:
        adapter.detach()


def test_a_merged_adapter_keeps_the_fused_kernels_on_inside_and_outside_its_block(
    tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A merged adapter stays attached while a server runs every mode; outside ``applied()`` its layers are the
    plain ones, so the step keeps the fused q/k/v kernel (one int4 call for three) and equals the plain step.
    Inside, the fused kernel still runs, with the adapter's low-rank term added to ``q_proj``'s rows (the default
    mode decodes as fast as ``naive``), and the step equals the one that calls the adapted modules. The profiler
    counts ATen's kernel calls, so the layers keep ATen's kernels here (``PC_RAG_DOT_LINEAR=0``)."""
    monkeypatch.setenv(DOT_SWITCH, "0")
    lm = tiny_in("llama", "int4", tokenizer)
    attn = lm.model.get_decoder().layers[0].self_attn
    step = DecodeStep.of(lm.model)
    assert step is not None
    prompt = tokenizer("The tower stands in Paris and is tall.", add_special_tokens=False)["input_ids"]
    buffers = [allocate(lm.model, len(prompt) + 8) for _ in range(4)]
    with torch.inference_mode():
        for buffer in buffers:
            lm.model(input_ids=torch.tensor([prompt]), cache=buffer.cache(0), use_cache=True)
        before = step([5], len(prompt), buffers[0].cache(len(prompt)))
        adapter = acting_adapter(lm.model).attach(merged=True)
        try:
            assert kernel_corrections(attn.q_proj, attn.k_proj, attn.v_proj) == [None, None, None]
            with adapter.applied():
                acting = kernel_corrections(attn.q_proj, attn.k_proj, attn.v_proj)
                assert acting is not None and any(fix is not None for fix in acting)
            with torch.profiler.profile() as profiler:
                after = step([5], len(prompt), buffers[1].cache(len(prompt)))
                with adapter.applied():
                    adapted = step([5], len(prompt), buffers[2].cache(len(prompt)))
            with adapter.applied(), _unfused(step):
                modules = step([5], len(prompt), buffers[3].cache(len(prompt)))
            calls = [e for e in profiler.key_averages() if e.key == "aten::_weight_int4pack_mm_for_cpu"]
        finally:
            adapter.detach()
    assert torch.equal(before, after)
    layers = len(lm.model.get_decoder().layers)
    assert calls and calls[0].count == 2 * 4 * layers  # q/k/v, o, gate/up, down; adapter off, then on
    assert not torch.equal(adapted, after)
    torch.testing.assert_close(adapted, modules, rtol=0, atol=5e-2 * modules.abs().max().item())


@contextmanager
def _unfused(step: DecodeStep) -> Iterator[None]:
    """The step with its fused kernels taken away: every projection runs as its module."""
    kept = [(layer.qkv, layer.gate_up) for layer in step._layers]
    for layer in step._layers:
        layer.qkv = layer.gate_up = None
    try:
        yield
    finally:
        for layer, (qkv, gate_up) in zip(step._layers, kept, strict=True):
            layer.qkv, layer.gate_up = qkv, gate_up
