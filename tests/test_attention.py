"""The serving attention equals transformers' SDPA (with repeated KV heads) for any mask."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from pc_rag.attention import packed_gqa_attention


class _Module(torch.nn.Module):
    num_key_value_groups = 3
    is_causal = True
    training = False


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
