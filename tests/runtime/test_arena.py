"""The private arena keeps live rows contiguous, moves the last row into a finished one, and grows without loss."""

from __future__ import annotations

import torch

from pc_rag.runtime.arena import CAPACITY_STEP, PrivateArena


def _rows(n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, 2, 3, length, 4, generator=g)
    return keys, values


def test_retiring_a_row_moves_the_last_live_row_into_it():
    arena = PrivateArena(2, 3, 4, rows=4, capacity=8)
    rows = [_rows(1, 5 + i, i) for i in range(3)]
    assert [arena.admit(*r) for r in rows] == [0, 1, 2]
    assert arena.retire(0) == 2 and arena.active == 2
    torch.testing.assert_close(arena.keys[:, 0, :, :7], rows[2][0], rtol=0, atol=0)
    torch.testing.assert_close(arena.values[:, 1, :, :6], rows[1][1], rtol=0, atol=0)
    assert arena.lengths.tolist() == [7, 6, 0, 0]
    assert arena.retire(1) is None and arena.active == 1


def test_capacity_grows_in_steps_and_keeps_every_row():
    arena = PrivateArena(2, 3, 4, rows=2, capacity=8)
    assert arena.capacity == CAPACITY_STEP
    first = _rows(1, 10, 0)
    arena.admit(*first)
    second = _rows(1, CAPACITY_STEP + 5, 1)
    arena.admit(*second)
    assert arena.capacity % CAPACITY_STEP == 0 and arena.capacity >= CAPACITY_STEP + 5
    torch.testing.assert_close(arena.keys[:, 0, :, :10], first[0], rtol=0, atol=0)
    torch.testing.assert_close(arena.values[:, 1, :, : CAPACITY_STEP + 5], second[1], rtol=0, atol=0)
    assert not arena.keys[:, 0, :, 10:].any()  # padding is zeros, never garbage that could be NaN


def test_rows_grown_during_inference_take_writes_outside_it():
    arena = PrivateArena(2, 3, 4, rows=2, capacity=8)
    with torch.inference_mode():  # a decode step grows the rows
        arena.admit(*_rows(1, 10, 0))
        arena.reserve(CAPACITY_STEP + 1)
    arena.admit(*_rows(1, 5, 1))  # an admission outside inference mode writes into them
    assert arena.lengths.tolist() == [10, 5]


def test_growing_copies_only_the_live_rows_and_a_row_admitted_into_fresh_memory_is_finite(monkeypatch):
    arena = PrivateArena(2, 3, 4, rows=3, capacity=8)
    first = _rows(1, 10, 0)
    arena.admit(*first)
    real_new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda t, *shape: real_new_empty(t, *shape).fill_(float("nan")))
    arena.reserve(2 * CAPACITY_STEP)  # fresh memory here reads NaN, as uninitialized memory may
    assert arena.capacity >= 2 * CAPACITY_STEP + 10
    assert arena.keys[:, 1:].isnan().all()  # rows that were not live were not copied
    torch.testing.assert_close(arena.keys[:, 0, :, :10], first[0], rtol=0, atol=0)
    assert arena.keys[:, 0].isfinite().all() and arena.values[:, 0].isfinite().all()
    second = _rows(1, 7, 1)
    assert arena.admit(*second) == 1
    assert arena.keys[:, 1].isfinite().all() and arena.values[:, 1].isfinite().all()
    assert not arena.keys[:, 1, :, 7:].any()
