"""The refresh forward (query blocks, no mask) equals the same forward on the dense recompute mask."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import Cache

import pc_rag.attention as attention
from pc_rag.kv import allocate
from pc_rag.recompute import RefreshLayer, recompute_and_prefill, recompute_mask


@pytest.fixture(scope="module")
def models(tokenizer) -> dict[str, torch.nn.Module]:
    from conftest import tiny_model

    return {arch: tiny_model(arch, tokenizer).model for arch in ("llama", "gemma3")}


def _dense_forward(model, buffer, cached, selected, ids, positions) -> torch.Tensor:
    """The refresh forward with explicit [1, 1, S+N, T+N] masks (windowed for sliding layers)."""
    config = model.config.get_text_config()
    new = len(ids) - len(selected)
    mask: object = recompute_mask(cached, selected, new)
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        sliding = recompute_mask(cached, selected, new, window=config.sliding_window)
        mask = {"full_attention": mask, "sliding_attention": sliding}
    index = torch.as_tensor(selected, dtype=torch.long)
    layers = [RefreshLayer(buffer.keys[i], buffer.values[i], cached, index) for i in range(len(buffer.keys))]
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([ids]),
            position_ids=torch.tensor([positions]),
            attention_mask=mask,
            cache=Cache(layers=layers),
            logits_to_keep=1,
        )
    return out.logits[0, -1]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize(("seed", "size"), [(0, 4), (1, 7), (2, None), (3, 1)])
def test_refresh_equals_dense_mask_forward(
    monkeypatch: pytest.MonkeyPatch, models: dict[str, torch.nn.Module], arch: str, seed: int, size: int | None
) -> None:
    model = models[arch]
    gen = torch.Generator().manual_seed(seed)
    cached, new = 90, 6  # past the tiny Gemma 3's sliding window (24)
    selected = sorted(torch.randperm(cached, generator=gen)[: int(torch.randint(1, cached, (1,), generator=gen))])
    selected = [int(i) for i in selected]
    ids = torch.randint(0, 1000, (len(selected) + new,), generator=gen).tolist()
    positions = [*selected, *range(cached, cached + new)]
    buffer = allocate(model, cached + new)
    buffer.keys.normal_(generator=gen)
    buffer.values.normal_(generator=gen)
    reference_buffer = allocate(model, cached + new)
    reference_buffer.keys.copy_(buffer.keys)
    reference_buffer.values.copy_(buffer.values)

    of = attention.QueryBlocks.of
    monkeypatch.setattr(attention.QueryBlocks, "of", lambda index, _=None: of(index, size))
    # the refresh builds no mask and takes no dense path
    monkeypatch.setattr(attention, "sdpa_mask", _refuse)
    monkeypatch.setattr(attention, "sdpa_attention_forward", _refuse)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", _refuse)
    monkeypatch.setattr(attention.QueryBlocks, "dense", _refuse)
    logits, _ = recompute_and_prefill(
        model, buffer, cached, selected, ids[: len(selected)], selected, ids[len(selected) :], positions[-new:]
    )
    monkeypatch.undo()
    reference = _dense_forward(model, reference_buffer, cached, selected, ids, positions)
    torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
    # the blocked refresh and the dense reference take different kernels (the flash pass on the CPU, SDPA): one
    # thread rounds a value 1.1e-5 away, past assert_close's float32 default (atol 1e-5), as logits get 1e-4
    close = {"rtol": 1e-4, "atol": 1e-4}
    torch.testing.assert_close(buffer.keys[..., : cached + new, :], reference_buffer.keys[..., : cached + new, :])
    torch.testing.assert_close(
        buffer.values[..., : cached + new, :], reference_buffer.values[..., : cached + new, :], **close
    )


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("a dense mask or a dense attention path was used")
