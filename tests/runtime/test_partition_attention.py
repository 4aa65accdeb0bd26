"""Two-phase partition attention equals SDPA over each sequence's keys duplicated in full, for any sharing."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from pc_rag.runtime.partition_attention import SharedRun, partition_attention, private_mask

module = importlib.import_module("pc_rag.runtime.partition_attention")


def _visible(run: SharedRun) -> torch.Tensor:
    return torch.ones(run.keys.shape[1], dtype=torch.bool) if run.mask is None else run.mask == 0


def _reference(query, runs, private_keys, private_values, lengths, scale):
    """Per row: its runs' visible keys and its private keys concatenated (the duplicated KV), then SDPA."""
    kv_heads = private_keys.shape[1]
    out = []
    for b in range(query.shape[0]):
        mine = [r for r in runs if b in r.readers.tolist()]
        keys = torch.cat([r.keys[:, _visible(r)] for r in mine] + [private_keys[b, :, : lengths[b]]], dim=1)
        values = torch.cat([r.values[:, _visible(r)] for r in mine] + [private_values[b, :, : lengths[b]]], dim=1)
        q = query[b][None, :, None]  # [1, H, 1, D]
        o = F.scaled_dot_product_attention(q, keys[None], values[None], scale=scale, enable_gqa=kv_heads > 1)
        out.append(o[0, :, 0])
    return torch.stack(out)


def _case(seed: int, batch: int, sharing: list[list[bool]], heads=6, kv_heads=2, dim=16, device="cpu", gaps=False):
    """Random queries, runs read by the rows ``sharing`` names, and private rows; with ``gaps``, each run masks a
    few of its keys (padding between segments)."""
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, dim, generator=g)
    runs = []
    for readers in sharing:
        rows = [b for b, reads in enumerate(readers[:batch]) if reads]
        if rows:
            length = int(torch.randint(1, 40, (1,), generator=g))
            pool = torch.randn(2, kv_heads, length + 7, dim, generator=g)  # a view inside a larger pool
            mask = None
            if gaps:
                hidden = torch.rand(length, generator=g) < 0.3
                hidden[int(torch.randint(0, length, (1,), generator=g))] = False  # at least one key visible
                mask = torch.zeros(length).masked_fill_(hidden, float("-inf"))
            keys, values = pool[0, :, 3 : 3 + length], pool[1, :, 3 : 3 + length]
            runs.append(SharedRun(keys, values, torch.tensor(rows), mask))
    lengths = torch.randint(1, 12, (batch,), generator=g)
    private = torch.randn(2, batch, kv_heads, 12, dim, generator=g)
    fields = ((r.keys, r.values, r.readers, r.mask) for r in runs)
    moved = [SharedRun(*(t if t is None else t.to(device) for t in run)) for run in fields]
    mask = private_mask(lengths.to(device), 12, torch.float32)
    args = (query.to(device), moved, private[0].to(device), private[1].to(device), mask, dim**-0.5)
    return args, (query, runs, private[0], private[1], lengths, dim**-0.5)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 6),
    sharing=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), max_size=5),
)
def test_equals_sdpa_over_duplicated_kv_for_any_sharing(seed, batch, sharing):
    args, reference = _case(seed, batch, sharing)
    torch.testing.assert_close(partition_attention(*args), _reference(*reference), rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    batch=st.integers(1, 6),
    sharing=st.lists(st.lists(st.booleans(), min_size=6, max_size=6), min_size=1, max_size=4),
)
def test_keys_a_run_masks_count_for_nothing(seed, batch, sharing):
    """Segments stored back to back form one run whose padding is masked: those keys must weigh nothing."""
    args, reference = _case(seed, batch, sharing, gaps=True)
    torch.testing.assert_close(partition_attention(*args), _reference(*reference), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("others_read", [[], [1, 2, 3], [1, 3], [2]])
def test_a_row_merges_to_the_same_bits_alone_as_beside_rows_reading_other_runs(others_read):
    """Row 0 reads runs A and C; in a batch, other rows may also read a run B between them: row 0's output must
    not change by one bit, whichever merge the batch takes."""
    g = torch.Generator().manual_seed(3)
    query, private = torch.randn(4, 6, 16, generator=g), torch.randn(2, 4, 2, 12, 16, generator=g)
    a, b, c = (torch.randn(2, 2, length, 16, generator=g) for length in (37, 20, 70))
    mask = private_mask(torch.tensor([5, 12, 3, 9]), 12, torch.float32)
    alone = partition_attention(
        query[:1], [SharedRun(*a, torch.tensor([0])), SharedRun(*c, torch.tensor([0]))], private[0, :1],
        private[1, :1], mask[:1], 0.25,
    )  # fmt: skip
    runs = [SharedRun(*a, torch.arange(4)), SharedRun(*b, torch.tensor(others_read)), SharedRun(*c, torch.arange(4))]
    runs = [run for run in runs if len(run.readers)]
    batched = partition_attention(query, runs, private[0], private[1], mask, 0.25)
    assert torch.equal(batched[0], alone[0])


def test_merge_gives_a_row_the_same_bits_at_any_place_in_any_batch():
    """Every row, in batches of 1 to 9 rows and at any place in them, gets the bits it gets alone: neither the
    passes nor the merge may depend on how many rows there are or where a row sits (the vector loops' lanes and
    tails are placed by the batch size; ``test_avx2_kernels`` runs this on the AVX2 kernels too)."""
    g = torch.Generator().manual_seed(5)
    rows, heads, kv_heads, dim, capacity = 9, 6, 2, 16, 64
    query = torch.randn(rows, heads, dim, generator=g)
    private = torch.randn(2, rows, kv_heads, capacity, dim, generator=g)
    mask = private_mask(torch.randint(1, capacity + 1, (rows,), generator=g), capacity, torch.float32)
    shared = [torch.randn(2, kv_heads, length, dim, generator=g) for length in (37, 20, 70)]
    reads = [set(range(rows)), {1, 2, 5, 8}, {0, 3, 4, 5}]  # who reads each run

    def attend(batch: list[int]) -> torch.Tensor:
        runs = []
        for (keys, values), readers in zip(shared, reads, strict=True):
            mine = [place for place, row in enumerate(batch) if row in readers]
            if mine:
                runs.append(SharedRun(keys, values, torch.tensor(mine)))
        return partition_attention(query[batch], runs, private[0, batch], private[1, batch], mask[batch], 0.25)

    alone = [attend([row])[0] for row in range(rows)]
    for size in range(1, rows + 1):
        batch = torch.randperm(rows, generator=g)[:size].tolist()
        for place, row in enumerate(attend(batch)):
            assert torch.equal(row, alone[batch[place]]), f"row {batch[place]} at place {place} of {size}"


@pytest.mark.parametrize("gaps", [False, True])
def test_without_the_fused_kernel_the_matmul_path_agrees(monkeypatch, gaps):
    sharing = [[True] * 6, [True, False, True, False, True, False], [False, True] * 3]
    args, reference = _case(3, 5, sharing, gaps=gaps)
    fused = partition_attention(*args)
    monkeypatch.setattr(module, "FLASH_CPU", None)
    torch.testing.assert_close(partition_attention(*args), fused, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(partition_attention(*args), _reference(*reference), rtol=1e-5, atol=1e-5)


def test_one_query_head_per_kv_head_and_bfloat16():
    args, reference = _case(7, 4, [[True] * 6], heads=2, kv_heads=2)
    torch.testing.assert_close(partition_attention(*args), _reference(*reference), rtol=1e-5, atol=1e-5)
    query, runs, keys, values, mask, scale = args
    low = [SharedRun(r.keys.bfloat16(), r.values.bfloat16(), r.readers) for r in runs]
    out = partition_attention(query.bfloat16(), low, keys.bfloat16(), values.bfloat16(), mask.bfloat16(), scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(*reference), rtol=0.05, atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_cuda_agrees_with_cpu():
    args, reference = _case(11, 4, [[True] * 6, [False, True] * 3], device="cuda")
    torch.testing.assert_close(partition_attention(*args).cpu(), _reference(*reference), rtol=1e-4, atol=1e-4)
