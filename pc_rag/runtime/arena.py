"""The private KV of the sequences decoding together: one padded row per sequence, live rows kept contiguous.

Row ``b`` of ``keys``/``values`` ``[L, rows, H_kv, capacity, D]`` holds ``lengths[b]`` entries: what no other
request shares (the tokens computed for this request, spans its recovery changed, the tokens it generated).
Rows ``0..active-1`` are live; when a sequence finishes, the last live row moves into its place, so a decode
step reads one block ``[:active]``. The capacity grows when a row would overflow: a copy of the live rows only, so
that one long request served alone does not pay for every row (a 16-row float32 arena at 2K is 1.9 GB). Every
entry of a live row holds a finite number (padding enters attention with weight 0, and 0 times NaN is NaN): fresh
memory is zeroed when a row is admitted into it. This module knows nothing about models or requests.
"""

from __future__ import annotations

import torch

# Capacities are multiples of this: attention over a padded row reduces over the whole capacity, and the CPU's
# vector loops (8 floats wide on AVX2, 16 on AVX-512) give the row's own entries the same lanes (the same bits) at
# any such capacity
CAPACITY_STEP = 64


class PrivateArena:
    """Padded per-sequence KV rows; not thread-safe (one scheduler thread owns it)."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, *, rows: int, capacity: int = 256,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        shape = (layers, rows, kv_heads, _rounded(capacity), head_dim)
        # zeros, not empty: padding is masked out of attention, but a NaN left in memory would still poison it
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # [L, rows, H_kv, capacity, D]
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)
        self.host_lengths = [0] * rows  # the same on the host: bookkeeping reads it without a device sync
        self.finite = [True] * rows  # whether every entry of the row is a finite number (fresh memory may not be)
        self.active = 0

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    def admit(self, keys: torch.Tensor, values: torch.Tensor) -> int:
        """A new live row holding ``keys``/``values`` [L, H_kv, n, D]; its index."""
        assert self.active < self.rows, "no free row: the scheduler admits at most `rows` sequences"
        n = keys.shape[2]
        self.reserve(n)
        row = self.active
        self.keys[:, row, :, :n] = keys
        self.values[:, row, :, :n] = values
        if not self.finite[row]:
            self.keys[:, row, :, n:] = 0
            self.values[:, row, :, n:] = 0
            self.finite[row] = True
        self.lengths[row] = self.host_lengths[row] = n
        self.active += 1
        return row

    def retire(self, row: int) -> int | None:
        """Free ``row``; the last live row moves into it. Returns the moved row's former index (None if none moved)."""
        last = self.active - 1
        assert 0 <= row <= last, f"row {row} is not live"
        moved = None
        if row != last:
            n = self.host_lengths[last]
            self.keys[:, row, :, :n] = self.keys[:, last, :, :n]
            self.values[:, row, :, :n] = self.values[:, last, :, :n]
            self.lengths[row] = self.host_lengths[row] = n
            moved = last
        self.lengths[last] = self.host_lengths[last] = 0
        self.active = last
        return moved

    def advance(self, rows: int) -> None:
        """One more entry in each of the first ``rows`` live rows (a decode step wrote them)."""
        self.lengths[:rows] += 1
        for row in range(rows):
            self.host_lengths[row] += 1

    def advance_rows(self, rows: list[int], index: torch.Tensor) -> None:
        """One more entry in each live row of ``rows`` (``index``: the same rows as a device tensor)."""
        self.lengths[index] += 1
        for row in rows:
            self.host_lengths[row] += 1

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more entries in every live row (and ``tokens`` in a new one)."""
        needed = max(self.host_lengths[: self.active], default=0) + tokens
        if needed <= self.capacity:
            return
        capacity, live, before = _rounded(max(needed, 2 * self.capacity)), self.active, self.capacity
        for name in ("keys", "values"):
            old = getattr(self, name)
            with torch.inference_mode(False):  # a normal tensor, whether or not the caller is in inference mode
                new = old.new_empty(*old.shape[:3], capacity, old.shape[4])
            new[:, :live, :, :before] = old[:, :live]
            new[:, :live, :, before:] = 0
            setattr(self, name, new)
        self.finite[live:] = [False] * (self.rows - live)


def _rounded(capacity: int) -> int:
    return -(-max(capacity, 1) // CAPACITY_STEP) * CAPACITY_STEP
