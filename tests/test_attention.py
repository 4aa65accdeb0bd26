"""The serving attention equals transformers' SDPA (with repeated KV heads) on the dense mask it stands for."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

import pc_rag.attention as attention
from pc_rag.attention import QueryBlocks, packed_gqa_attention


class _Module(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True
    training = False


def _dense(index: torch.Tensor, keys: int, window: int | None) -> torch.Tensor:
    """Bool [1, 1, Q, keys]: query i sees keys j <= index[i] (and index[i] - j < window)."""
    key = torch.arange(keys)
    allowed = key <= index[:, None]
    if window is not None:
        allowed &= index[:, None] - key < window
    return allowed[None, None]


def _module(query: torch.Tensor, key: torch.Tensor) -> _Module:
    module = _Module()
    module.num_key_value_groups = query.shape[1] // key.shape[1]
    return module


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return sdpa_attention_forward(_module(query, key), query, key, value, mask, scaling=0.25)[0]


@pytest.mark.parametrize("kind", ["cache-then-causal", "random", "sliding"])
def test_packed_attention_matches_sdpa(kind: str) -> None:
    torch.manual_seed(0)
    q_len, cached, dim = 7, 50, 16
    query = torch.randn(2, 6, q_len, dim)
    key, value = torch.randn(2, 2, cached + q_len, dim), torch.randn(2, 2, cached + q_len, dim)
    mask = torch.ones(2, 1, q_len, cached + q_len, dtype=torch.bool)
    mask[..., cached:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    if kind == "random":
        mask &= torch.rand(mask.shape) > 0.3
        mask[..., cached:] |= torch.eye(q_len, dtype=torch.bool)  # every query sees itself
    elif kind == "sliding":
        mask[..., : cached - 20] = False
    ours, _ = packed_gqa_attention(_Module(), query, key, value, mask, scaling=0.25)
    reference, _ = sdpa_attention_forward(_Module(), query, key, value, mask, scaling=0.25)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False], ids=["cpu-kernel", "dense-sdpa"])
@pytest.mark.parametrize("window", [None, 5, 40, 10**6])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)], ids=["gqa", "mha"])
@pytest.mark.parametrize("seed", range(4))
def test_query_blocks_equal_sdpa_on_the_dense_mask(
    monkeypatch: pytest.MonkeyPatch, fused: bool, window: int | None, heads: tuple[int, int], seed: int
) -> None:
    """Random sorted selections of a random cache, then new tokens; blocks of random size."""
    if not fused:
        monkeypatch.setattr(attention, "FLASH_CPU", None)  # what a CUDA device runs
    gen = torch.Generator().manual_seed(seed)
    cached, new = int(torch.randint(1, 300, (1,), generator=gen)), int(torch.randint(1, 40, (1,), generator=gen))
    density = float(torch.rand(1, generator=gen))
    selected = torch.nonzero(torch.rand(cached, generator=gen) < density).flatten()  # may hold index 0, or nothing
    index = torch.cat((selected, torch.arange(cached, cached + new)))
    size = [1, 3, 16, None][seed]
    dim = 16
    query = torch.randn(2, heads[0], len(index), dim, generator=gen)
    key = torch.randn(2, heads[1], cached + new, dim, generator=gen)
    value = torch.randn(2, heads[1], cached + new, dim, generator=gen)
    blocks = QueryBlocks.of(index, size)
    kwargs = {"sliding_window": window} if window is not None else {}
    module = _module(query, key)
    ours, _ = packed_gqa_attention(module, query, key, value, None, scaling=0.25, query_blocks=blocks, **kwargs)
    reference = _reference(query, key, value, _dense(index, cached + new, window))
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("cached", "new"), [(1, 5), (40, 7), (30, 300)])
def test_no_mask_means_causal_after_the_cache(monkeypatch: pytest.MonkeyPatch, cached: int, new: int) -> None:
    """A causal run after a cache (prefix caching: a short head, many new tokens) is two kernel calls, no mask:
    the cache unmasked, the new keys by the causal kernel."""
    calls: list[dict[str, object]] = []
    kernel = attention.FLASH_CPU

    def recording(*args: object, **kwargs: object) -> object:
        calls.append(kwargs)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention, "FLASH_CPU", recording)
    monkeypatch.setattr(attention, "sdpa_attention_forward", _refuse)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", _refuse)
    torch.manual_seed(0)
    query = torch.randn(1, 6, new, 16)
    key, value = torch.randn(1, 2, cached + new, 16), torch.randn(1, 2, cached + new, 16)
    ours, _ = packed_gqa_attention(_Module(), query, key, value, None, scaling=0.25)
    monkeypatch.undo()
    assert len(calls) == 2 and all(c.get("attn_mask") is None for c in calls)
    assert [bool(c.get("is_causal")) for c in calls] == [False, True]
    reference = _reference(query, key, value, _dense(torch.arange(cached, cached + new), cached + new, None))
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)


def test_plain_causal_masks_are_not_built() -> None:
    common = dict(batch_size=1, q_length=300, kv_length=330, q_offset=30, device="cpu")
    assert attention._mask(**common, mask_function=causal_mask_function) is None
    assert attention._mask(**common, mask_function=causal_mask_function, attention_mask=torch.ones(1, 330)) is None
    padded = torch.ones(1, 330, dtype=torch.bool)
    padded[0, 0] = False
    for built in (
        attention._mask(**common, mask_function=causal_mask_function, attention_mask=padded),
        attention._mask(**common, mask_function=sliding_window_causal_mask_function(64), local_size=64),
    ):
        assert built is not None and built.shape == (1, 1, 300, 330)


def test_band_masks_are_made_once_and_stay_small() -> None:
    index = torch.cat((torch.arange(10, 2000, 4), torch.arange(2000, 2050)))  # 25% of a 2K cache, then 50 new
    blocks = QueryBlocks.of(index)
    pieces = blocks.pieces(None, 3, torch.float32)
    assert blocks.pieces(None, 3, torch.float32) is pieces  # shared by every layer
    masked = sum(p.mask.numel() for block in pieces for p in block if p.mask is not None)
    assert masked < 3 * 64 * 2 * 2050  # ~ queries per block x cache length, not queries x cache length
    assert all(block[0].mask is None and block[0].start == 0 for block in pieces)  # each block's head is unmasked


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("a dense attention path was taken")
