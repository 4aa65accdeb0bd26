"""The decode step's layers in C++ (``native_layers``, ``csrc/decode_layers.cpp``) give the Python loop's bits:
logits of every step, plain and speculative, with and without a merged splice adapter, on every architecture the
step describes; and they step aside wherever something acts that they do not compute."""

from __future__ import annotations

import pytest
import torch
from conftest import acting_adapter
from test_speculation import DESCRIBED, _decode_under, _oracle
from test_weights import tiny_in

from pc_rag.runtime import cpu_kernels
from pc_rag.runtime.decode_step import DecodeStep
from pc_rag.runtime.native_layers import NativeLayers
from pc_rag.runtime.speculation import PromptLookup

pytestmark = pytest.mark.skipif(cpu_kernels.decode_layers() is None, reason="the CPU kernels do not run here")

PROMPT = "The red tower stands in Paris. Where is it?"


def _counting(monkeypatch: pytest.MonkeyPatch, native: bool) -> list[bool]:
    """Runs the layers natively or not (``native``); returns a list that records, per step, whether they ran in C++."""
    ran: list[bool] = []
    run = NativeLayers.run

    def counted(self, *args, **kwargs):
        out = run(self, *args, **kwargs) if native else None
        ran.append(out is not None)
        return out

    monkeypatch.setattr(NativeLayers, "run", counted)
    return ran


@pytest.mark.parametrize("merged", [False, True], ids=["naive", "merged adapter"])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("arch", DESCRIBED)
def test_native_layers_give_the_python_loops_bits(tokenizer, arch: str, dtype: str, merged: bool, monkeypatch) -> None:
    lm = tiny_in(arch, dtype, tokenizer)
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    adapter = acting_adapter(lm.model).attach(merged=True) if merged else None
    try:
        outputs = {}
        for native in (False, True):
            for speculative in (False, True):
                with monkeypatch.context() as patch:
                    ran = _counting(patch, native)
                    if speculative:  # drafts of 0 to 3 tokens, some ending in a wrong one
                        patch.setattr(PromptLookup, "propose", _oracle(outputs[native, False][0], len(tokenizer)))
                    outputs[native, speculative] = _decode(lm, adapter, prompt, speculative)
                assert ran and all(ran) == native and any(ran) == native
    finally:
        if adapter is not None:
            adapter.detach()
    reference_tokens, reference_logits = outputs[False, False]
    for (native, speculative), (tokens, logits) in outputs.items():
        assert tokens == reference_tokens, (native, speculative)
        assert torch.equal(logits, reference_logits), (native, speculative)


def _decode(lm, adapter, prompt: list[int], speculative: bool) -> tuple[list[int], torch.Tensor]:
    """The greedy answer and every step's logits, under ``adapter`` (merged) where one is given."""
    tokens, decoded = _decode_under(adapter, lm.model, prompt, speculative=speculative)
    return tokens, torch.stack(decoded.step_logits)


def test_a_hook_on_a_layer_runs_the_python_loop(tokenizer, monkeypatch) -> None:
    """A forward hook acts inside the layer, where the C++ loop cannot call it: the step runs its Python loop."""
    lm = tiny_in("llama", "int4", tokenizer)
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    seen: list[int] = []
    handle = lm.model.model.layers[1].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(1))
    try:
        ran = _counting(monkeypatch, native=True)
        _decode(lm, None, prompt, speculative=False)
    finally:
        handle.remove()
    assert ran and not any(ran)
    assert len(seen) > len(ran)  # prefill and every step called the hook


def test_dense_models_have_no_native_layers(tokenizer) -> None:
    for dtype in ("float32", "bfloat16"):
        step = DecodeStep.of(tiny_in("llama", dtype, tokenizer).model)
        assert step is not None
        assert NativeLayers.of(step._layers) is None


def test_the_switch_turns_the_native_layers_off(tokenizer, monkeypatch) -> None:
    step = DecodeStep.of(tiny_in("llama", "int4", tokenizer).model)
    assert step is not None and NativeLayers.of(step._layers) is not None
    monkeypatch.setenv("PC_RAG_NATIVE_LAYERS", "0")
    assert NativeLayers.of(step._layers) is None


def test_bad_arguments_are_refused_with_what_was_wrong(tokenizer) -> None:
    step = DecodeStep.of(tiny_in("llama", "int4", tokenizer).model)
    assert step is not None
    native = NativeLayers.of(step._layers)
    assert native is not None
    cls = cpu_kernels.decode_layers()
    with pytest.raises(RuntimeError, match="kernel kind is 4 or 8"):
        cls([], [[1, 1, 1], [1, 1]], [4, 4, 4, 5], [1e-5] * 4, 4, 2, 16, 0.25)
    with pytest.raises(RuntimeError, match="layer 0 has 2 tensors"):
        cls([[None, None]], [[1, 1, 1], [1, 1]], [4, 4, 4, 4], [1e-5] * 4, 4, 2, 16, 0.25)
    x = torch.zeros(1, 1, 64, dtype=torch.bfloat16)
    rotary = (torch.zeros(1, 1, 16, dtype=torch.bfloat16),) * 2
    cache = torch.zeros(3, 1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="past the cache"):
        native.run(x, rotary, cache, cache.clone(), 8, 1, torch.tensor([9]))
    with pytest.raises(RuntimeError, match="for 3 layers"):
        native.run(x, rotary, cache[:2], cache[:2].clone(), 0, 1, torch.tensor([1]))
