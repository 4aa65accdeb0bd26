"""The splice adapter acts only inside ``applied()``, equals merged LoRA weights there, and loads only for its model."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import acting_adapter
from safetensors.torch import save_file

from pc_rag.rag.adapter import AdapterConfig, AdapterError, SpliceAdapter


def logits(lm, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return lm.model(input_ids=torch.tensor([ids])).logits[0]


@pytest.fixture
def adapted(tiny_lm):
    names = {n.rsplit(".", 1)[-1] for n, _ in tiny_lm.model.named_modules()}
    query = "q_proj" if "q_proj" in names else "qkv_proj"  # Phi-3 fuses q, k and v
    adapter = SpliceAdapter(tiny_lm.model, AdapterConfig(rank=4, targets=(query, "o_proj")), "fp").attach()
    with torch.no_grad():
        for p in adapter.lora_b.values():
            p.normal_(0, 0.5)  # B starts at zero: make the adapter do something
    yield tiny_lm, adapter
    adapter.detach()


IDS = [12, 400, 77, 2000, 31, 9, 1200]


def test_inactive_outside_applied_and_gone_after_detach(tiny_lm, adapted) -> None:
    lm, adapter = adapted
    adapter.detach()
    base = logits(lm, IDS)
    adapter.attach()
    assert torch.equal(logits(lm, IDS), base)
    with adapter.applied():
        assert not torch.allclose(logits(lm, IDS), base, atol=1e-3)
    assert torch.equal(logits(lm, IDS), base)


def test_applied_equals_merged_weights(adapted) -> None:
    lm, adapter = adapted
    with adapter.applied():
        hooked = logits(lm, IDS)
    adapter.detach()
    layers = dict(lm.model.get_decoder().layers.named_modules())
    saved = {}
    with torch.no_grad():
        for key, a in adapter.lora_a.items():
            name = next(n for n in layers if n.replace(".", "_") == key)
            saved[name] = layers[name].weight.clone()
            layers[name].weight += adapter.config.scale * adapter.lora_b[key] @ a
        merged = logits(lm, IDS)
        for name, weight in saved.items():
            layers[name].weight.copy_(weight)
    assert torch.allclose(hooked, merged, atol=1e-4, rtol=1e-4)


def test_merged_attach_equals_hooks_and_detaches_cleanly(adapted) -> None:
    lm, adapter = adapted
    base = logits(lm, IDS)
    with adapter.applied():
        hooked = logits(lm, IDS)
    adapter.detach()
    adapter.attach(merged=True)
    assert not adapter._hooks  # serving runs the folded weights, not the low-rank hooks
    assert torch.equal(logits(lm, IDS), base)
    with adapter.applied():
        assert torch.allclose(logits(lm, IDS), hooked, atol=1e-4, rtol=1e-4)
    other = SpliceAdapter(lm.model, adapter.config, "fp")
    with pytest.raises(AdapterError, match="detach it first"):
        other.attach(merged=True)
    adapter.detach()
    assert all("forward" not in m.__dict__ for m in lm.model.modules())
    with adapter.applied():
        assert torch.equal(logits(lm, IDS), base)
    adapter.attach()


@pytest.mark.parametrize("merged", [False, True])
def test_skipped_rows_run_as_the_plain_model(adapted, merged: bool) -> None:
    """Skipping the first n rows of a call equals a plain call for them, then an adapted call after their cache."""
    lm, adapter = adapted
    if merged:
        adapter.detach()
        adapter.attach(merged=True)
    n = 3
    with torch.no_grad():
        plain = lm.model(input_ids=torch.tensor([IDS[:n]]), use_cache=True)
        with adapter.applied():
            after = lm.model(input_ids=torch.tensor([IDS[n:]]), cache=plain.cache).logits[0]
        with adapter.applied(skip_rows=n):
            skipped = logits(lm, IDS)
    assert torch.allclose(skipped[:n], plain.logits[0], atol=1e-5)
    assert torch.allclose(skipped[n:], after, atol=1e-4, rtol=1e-4)
    with adapter.applied():
        assert not torch.allclose(logits(lm, IDS)[:n], skipped[:n], atol=1e-3)


def test_applied_is_per_thread(adapted) -> None:
    lm, adapter = adapted
    base = logits(lm, IDS)
    seen: list[torch.Tensor] = []
    with adapter.applied():
        worker = threading.Thread(target=lambda: seen.append(logits(lm, IDS)))
        worker.start()
        worker.join()
    assert torch.equal(seen[0], base)


def test_save_load_roundtrip_and_refusals(adapted, tmp_path) -> None:
    lm, adapter = adapted
    path = tmp_path / "adapter.safetensors"
    adapter.save(path)
    loaded = SpliceAdapter.load(path, lm.model, "fp")
    assert loaded.config == adapter.config
    for key, p in adapter.lora_b.items():
        assert torch.equal(loaded.lora_b[key], p)
    with pytest.raises(AdapterError, match="trained for model fp, not other"):
        SpliceAdapter.load(path, lm.model, "other")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(AdapterError, match="not a pc-rag splice adapter"):
        SpliceAdapter.load(tmp_path / "plain.safetensors", lm.model, "fp")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(AdapterError, match="cannot read"):
        SpliceAdapter.load(tmp_path / "junk.safetensors", lm.model, "fp")
    with pytest.raises(AdapterError, match="no linear layer named"):
        SpliceAdapter(lm.model, AdapterConfig(targets=("nope",)), "fp")


def test_only_the_applied_adapter_acts(adapted) -> None:
    lm, first = adapted
    with first.applied():
        alone = logits(lm, IDS)
    second = SpliceAdapter(lm.model, first.config, "fp").attach()
    try:
        with torch.no_grad():
            for p in second.lora_b.values():
                p.normal_(0, 0.5)
        with first.applied():
            assert torch.equal(logits(lm, IDS), alone)
    finally:
        second.detach()


def test_a_quantized_model_serves_the_adapter_of_its_float32_weights(tokenizer, tmp_path, monkeypatch) -> None:
    """int8/int4 weights are the float32 model's, quantized: its adapter is looked up and loaded for them (its
    pairs kept in float32, its fingerprint the one it was fitted for); another model's is still refused."""
    from test_weights import tiny_in

    from pc_rag.rag import RagEngine, RagPrompt
    from pc_rag.rag.modes import DEFAULT_MODE
    from pc_rag.rag.tuned import adapter_file

    monkeypatch.setenv("PC_RAG_CACHE", str(tmp_path))
    lm = tiny_in("llama", "int4", tokenizer)
    lm.base_fingerprint = "dense"
    assert lm.fitted_fingerprints() == (lm.fingerprint(), "dense")
    fitted = acting_adapter(tiny_in("llama", "float32", tokenizer).model, rank=2, fingerprint="dense")
    path = tmp_path / "tuned" / adapter_file("dense")
    fitted.save(path)
    loaded = SpliceAdapter.load(path, lm.model, lm.fitted_fingerprints())
    assert loaded.fingerprint == "dense" and loaded.digest == fitted.digest
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    with pytest.raises(AdapterError, match=f"trained for model dense, not {lm.fingerprint()}"):
        SpliceAdapter.load(path, lm.model, lm.fingerprint())
    engine = RagEngine(lm, RagPrompt())
    assert engine.tuned.has_adapter() and engine.default_mode == DEFAULT_MODE
    adapter = engine.tuned.adapter()
    try:
        assert adapter.fingerprint == "dense"
        chunks = engine.encode(["The Zorblax Tower was designed by Mirela Vantok."])
        assert engine.answer(chunks, "Who designed it?", "fast", max_new_tokens=3).token_ids
    finally:
        adapter.detach()


def test_a_merged_adapter_on_an_int4_layer_gives_a_decode_row_the_same_bits_in_any_step(tokenizer) -> None:
    """Batched decoding equals decoding alone only if a row's bits do not depend on the other rows: up to
    KERNEL_ROWS rows an adapted int4 layer runs its kernel plus the low-rank term row by row, many rows (prefill)
    the merged dense weight; both apply the same adapted weight."""
    from test_weights import tiny_in

    from pc_rag.weights import KERNEL_ROWS

    lm = tiny_in("llama", "int4", tokenizer)
    adapter = acting_adapter(lm.model)
    adapter.attach(merged=True)
    layer = lm.model.get_decoder().layers[0].self_attn.q_proj
    x = torch.randn(1, 9, layer.in_features).bfloat16()
    try:
        with torch.no_grad(), adapter.applied():
            rows = layer(x[:, :KERNEL_ROWS])
            for t in range(KERNEL_ROWS):
                assert torch.equal(layer(x[:, t : t + 1]), rows[:, t : t + 1])
            dense = layer(x)  # 9 rows: the merged dense weight
        plain = layer(x[:, :KERNEL_ROWS])
        torch.testing.assert_close(rows.float(), dense[:, :KERNEL_ROWS].float(), rtol=2e-2, atol=2e-2)
        assert (rows.float() - plain.float()).abs().max() > 0.1  # the adapter acts
    finally:
        adapter.detach()
