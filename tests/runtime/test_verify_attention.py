"""A speculative step's rows attend in one call: each row as the exact one-row call would (within rounding), and
with the same bits wherever in a step the row sits, across bucket boundaries too."""

from __future__ import annotations

import pytest
import torch

from pc_rag.runtime.decode_step import STEP_ROWS, cache_attention
from pc_rag.runtime.verify_attention import BUCKET, BucketedAttention, bucket_end

KV_HEADS, N_REP, HEAD_DIM, SCALE = 2, 3, 16, 0.25


def _cache(slots: int, written: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [1, H_kv, slots, D]: random through ``written``, zeros past it (as the step leaves them)."""
    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(1, KV_HEADS, slots, HEAD_DIM, generator=generator) for _ in range(2))
    keys[..., written:, :] = 0
    values[..., written:, :] = 0
    return keys, values


def test_buckets_end_on_multiples_of_the_bucket() -> None:
    assert [bucket_end(s) for s in (0, BUCKET - 1, BUCKET, 2 * BUCKET + 5)] == [BUCKET, BUCKET, 2 * BUCKET, 3 * BUCKET]


@pytest.mark.parametrize(("length", "count"), [(0, 1), (5, 4), (BUCKET - 3, 4), (BUCKET - 1, 1), (BUCKET, 3), (200, 2)])
def test_each_row_attends_as_the_exact_one_row_call(length: int, count: int) -> None:
    keys, values = _cache(bucket_end(length + count - 1), length + count)
    q = torch.randn(STEP_ROWS, KV_HEADS * N_REP, 1, HEAD_DIM)
    attention = BucketedAttention(length, count, torch.float32, torch.device("cpu"))
    got = attention(q, keys, values, SCALE)
    want = torch.cat([
        cache_attention(q[t : t + 1], keys[:, :, : length + t + 1], values[:, :, : length + t + 1], SCALE)
        for t in range(count)
    ])  # fmt: skip
    assert got.shape == (count, 1, KV_HEADS * N_REP * HEAD_DIM)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("slot", [3, BUCKET - 2, BUCKET - 1, BUCKET, BUCKET + 1, 3 * BUCKET + 7])
def test_a_row_gets_the_same_bits_wherever_it_sits_in_a_step(slot: int) -> None:
    """The row at ``slot`` as the fed token (t = 0) and as draft t of a step that starts t slots earlier, beside
    other rows' queries: its keys through the end of its bucket, its row count fixed."""
    keys, values = _cache(bucket_end(slot + STEP_ROWS), slot + STEP_ROWS)
    own = torch.randn(KV_HEADS * N_REP, 1, HEAD_DIM)
    outs = []
    for t in range(min(STEP_ROWS, slot + 1)):
        for count in range(t + 1, STEP_ROWS + 1):
            q = torch.randn(STEP_ROWS, KV_HEADS * N_REP, 1, HEAD_DIM)
            q[t] = own
            attention = BucketedAttention(slot - t, count, torch.float32, torch.device("cpu"))
            outs.append(attention(q, keys, values, SCALE)[t])
    assert len(outs) > 1
    assert all(torch.equal(out, outs[0]) for out in outs)
