"""APE calibration: the identity is plain attention; otherwise it equals APE's two-part log-sum-exp merge."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pc_rag.calibration import Calibration, Segments, calibrated_attention
from pc_rag.errors import PCRagError


def case(seed: int, q_len: int = 5, total: int = 40, heads: int = 6, kv_heads: int = 2, dim: int = 8):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, q_len, dim, generator=g)
    k = torch.randn(1, kv_heads, total, dim, generator=g)
    v = torch.randn(1, kv_heads, total, dim, generator=g)
    cached = total - q_len
    allowed = torch.ones(q_len, total, dtype=torch.bool)
    allowed[:, cached:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    return q, k, v, allowed[None, None], cached


def ape_reference(q, k, v, allowed, stale, scaling, t, s):
    """APE as its paper and code state it: chunk part at temperature t, other part exact, LSE merge with s*t."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
    scores = q @ k.transpose(-1, -2) * scaling  # [1, H, Q, S]
    chunk = allowed & stale
    other = allowed & ~stale
    sc = (scores / t).masked_fill(~chunk, float("-inf"))
    so = scores.masked_fill(~other, float("-inf"))
    lse_c, lse_o = sc.logsumexp(-1, keepdim=True), so.logsumexp(-1, keepdim=True)
    out_c, out_o = sc.softmax(-1) @ v, so.softmax(-1) @ v
    w = torch.cat([lse_c * s * t, lse_o], -1).softmax(-1)
    return (w[..., :1] * out_c + w[..., 1:] * out_o).transpose(1, 2)


@pytest.mark.parametrize("seed", range(4))
def test_identity_is_plain_attention(seed: int) -> None:
    q, k, v, allowed, cached = case(seed)
    stale = torch.zeros(k.shape[2], dtype=torch.bool)
    stale[3:cached] = True
    got = calibrated_attention(q, k, v, allowed, stale, 0.35, 1.0, 1.0)
    n_rep = q.shape[1] // k.shape[1]
    want = F.scaled_dot_product_attention(
        q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1), attn_mask=allowed, scale=0.35
    ).transpose(1, 2)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize(("t", "s"), [(0.9, 1.0), (0.8, 1.2), (1.1, 0.9)])
@pytest.mark.parametrize("seed", range(3))
def test_matches_ape_merge(seed: int, t: float, s: float) -> None:
    q, k, v, allowed, cached = case(seed)
    segments = Segments(3, cached, Calibration(t, s), recomputed=torch.tensor([5, 9, 20]))
    stale = segments.stale_mask(k.shape[2], k.device)
    assert not stale[5] and stale[6] and not stale[2] and not stale[cached]
    got = calibrated_attention(q, k, v, allowed, stale, 0.35, t, s)
    assert torch.allclose(got, ape_reference(q, k, v, allowed, stale, 0.35, t, s), atol=1e-5)
    assert not torch.allclose(got, calibrated_attention(q, k, v, allowed, stale, 0.35, 1.0, 1.0), atol=1e-3)


def test_calibration_file_roundtrip_and_refusals(tmp_path) -> None:
    cal = Calibration(0.9, 1.0, per_layer=((0.9, 1.0), (1.0, 1.1)))
    cal.save(tmp_path / "c.json", "fp")
    assert Calibration.load(tmp_path / "c.json", "fp") == cal
    assert cal.at(1) == (1.0, 1.1) and Calibration().is_identity and not cal.is_identity
    with pytest.raises(PCRagError, match="fitted for model fp, not other"):
        Calibration.load(tmp_path / "c.json", "other")
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(PCRagError, match="not a pc-rag calibration"):
        Calibration.load(tmp_path / "bad.json", "fp")
    with pytest.raises(PCRagError, match="positive"):
        Calibration(0.0, 1.0)
