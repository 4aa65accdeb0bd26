"""ChunkAttention's two-phase partition attention for one decode step: KV that several sequences share is read once.

A batch of B sequences decodes one token each. Every sequence attends to some shared runs of KV (a preamble,
modules imported at the same positions: one copy in the shared pool, however many sequences read it) and to its
private KV (its own prompt tokens and what it generated, rows of a padded ``[B, H_kv, P, D]`` arena).

- Chunk-first: for each shared run, one pass of the queries of all the sequences that read it over its keys.
- Sequence-first: one masked pass of every sequence over its own private keys.

Each pass keeps every query's log-sum-exp, and the partial outputs are merged per sequence by it: the softmax
over the union of a sequence's keys, without duplicating the shared ones. Attention does not depend on the
order of its keys, so shared runs need not form a literal prefix. Query heads that share a KV head are folded
into the query axis (head ``h = g * n_rep + r`` reads KV head ``g``). This module knows nothing about models or
caches: it is handed tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pc_rag.attention import FLASH_CPU
from pc_rag.runtime.flex_attention import flex_with_lse

# Rows of a matmul come in multiples of this (batch rows, the queries of a shared run, a row's queries over its
# private keys): the CPU's float32 GEMM (MKL) and flash attention give a row the same bits at any row count that is
# a multiple of 4, on the AVX-512 and the AVX2 kernels and at 1 to 16 threads (measured with torch 2.13 and MKL
# 2024.2; 3 queries over several threads, or 1-3 rows of a GEMM, take other kernels), so padding keeps a row's
# result independent of how many others share the matmul. float32 and bfloat16 rows so get the same bits; int8 and
# int4 rows only while every matmul has at most ``weights.KERNEL_ROWS`` rows (past that, the dense copy)
ROW_MULTIPLE = 4


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of ``ROW_MULTIPLE``."""
    return -(-max(rows, 1) // ROW_MULTIPLE) * ROW_MULTIPLE


@dataclass(frozen=True)
class SharedRun:
    """One layer's view of a run of shared KV and the batch rows that attend to it; ``mask`` (additive, [S]) hides
    keys no reader may see (padding between segments stored back to back)."""

    keys: torch.Tensor  # [H_kv, S, D]
    values: torch.Tensor  # [H_kv, S, D]
    readers: torch.Tensor  # [n] long, distinct batch rows in increasing order
    mask: torch.Tensor | None = None  # [S], 0 or -inf


def private_mask(lengths: torch.Tensor, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [B, capacity] of private keys: row b sees its first ``lengths[b]`` (built once per decode
    step, for every layer)."""
    padding = torch.arange(capacity, device=lengths.device) >= lengths[:, None]
    return torch.zeros(padding.shape, dtype=dtype, device=lengths.device).masked_fill_(padding, float("-inf"))


def partition_attention(
    query: torch.Tensor,  # [B, H, D]: one new token per sequence, after RoPE
    runs: Sequence[SharedRun],
    private_keys: torch.Tensor,  # [B, H_kv, P, D]
    private_values: torch.Tensor,  # [B, H_kv, P, D]
    private: torch.Tensor,  # [B, P] additive (``private_mask``): each row sees at least one private key
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """Each row's attention over its shared runs and its private keys; see the module docstring."""
    batch, heads, dim = query.shape
    kv_heads = private_keys.shape[1]
    n_rep = heads // kv_heads
    grouped = query.view(batch, kv_heads, n_rep, dim)
    # each (row, KV head) is its own problem of n_rep queries; padded to ROW_MULTIPLE queries, it takes the same
    # kernels alone as in a batch (with several threads, 3 queries took others)
    out, lse = attend_with_lse(_padded(grouped), private_keys, private_values, private[:, None, None, :], scale)
    out, lse = out[:, :, :n_rep], lse[:, :, :n_rep]
    if not runs:
        return out.reshape(batch, heads, dim)
    outs, lses = [out], [lse]  # each part's output [n, H_kv, n_rep, D] and log-sum-exp over its n rows
    for run in runs:
        o, lse_run = chunk_first(grouped, run, scale)
        outs.append(o)
        lses.append(lse_run)
    merged = _merge(*_every_part_of_every_row(outs, lses, [run.readers for run in runs], batch))
    return merged.reshape(batch, heads, dim).to(query.dtype)


def chunk_first(grouped: torch.Tensor, run: SharedRun, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk-first pass over one shared run: the queries ``grouped`` [B, H_kv, n_rep, D] of its n readers in
    one pass over its keys; their output [n, H_kv, n_rep, D] and log-sum-exp [n, H_kv, n_rep]."""
    batch, kv_heads, n_rep, dim = grouped.shape
    n = run.readers.shape[0]
    every_row = n == batch  # distinct rows in increasing order: all of them, in order
    q = (grouped if every_row else grouped[run.readers]).transpose(0, 1).reshape(1, kv_heads, n * n_rep, dim)
    mask = run.mask[None, None, None, :] if run.mask is not None else None
    out, lse = attend_with_lse(_padded(q), run.keys[None], run.values[None], mask, scale)
    out, lse = out[:, :, : n * n_rep], lse[:, :, : n * n_rep]
    return out[0].unflatten(1, (n, n_rep)).transpose(0, 1), lse[0].unflatten(1, (n, n_rep)).transpose(0, 1)


def _padded(queries: torch.Tensor) -> torch.Tensor:
    """``queries`` [.., H_kv, Q, D] with its first query repeated up to ``padded_rows(Q)`` (outputs dropped after)."""
    pad = padded_rows(queries.shape[2]) - queries.shape[2]
    return torch.cat([queries, queries[:, :, :1].expand(-1, -1, pad, -1)], 2) if pad else queries


def _every_part_of_every_row(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor], readers: Sequence[torch.Tensor], batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts (the private one, then one per run, each over its readers) as float32 [T, B, H_kv, n_rep, D] and
    [T, B, H_kv, n_rep]: a row that does not read a run has output 0 and log-sum-exp -inf there, a part of weight
    exactly 0, so a row merges to the same bits whatever the other rows read."""
    if all(rows.shape[0] == batch for rows in readers):
        return torch.stack(outs).float(), torch.stack(lses).float()
    out = outs[0].new_zeros((len(outs), *outs[0].shape), dtype=torch.float32)
    lse = lses[0].new_full((len(lses), *lses[0].shape), float("-inf"), dtype=torch.float32)
    out[0], lse[0] = outs[0], lses[0]
    for part, rows in enumerate(readers, 1):
        out[part, rows], lse[part, rows] = outs[part].float(), lses[part].float()
    return out, lse


def _merge(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Parts ``out`` [T, B, H_kv, n_rep, D] merged into [B, H_kv, n_rep, D], each weighted by its share of its
    row's softmax mass (the parts' log-sum-exp ``lse`` [T, B, H_kv, n_rep]), added in part order.

    Elementwise operations only, so an element's bits depend on its own row's values, not on where the row sits
    or how many rows there are: max is exact, subtraction, products, sums in part order and the division are
    correctly rounded in any layout, and ``torch.exp`` gives the same bits in its vector loop and its scalar
    tail (measured on the AVX-512 and the AVX2 kernels). ``torch.softmax`` over a non-last dimension does not:
    with it a row's weights depended on the batch size, by 1e-8 (then 1e-6 in the logits of
    ``test_a_row_gets_the_same_bits_alone_as_in_any_batch``)."""
    weights = torch.exp(lse - lse.amax(0))  # the private part sees a key, so each row's max is finite
    weighted = out * weights[..., None]
    merged, total = weighted[0], weights[0]
    for part in range(1, out.shape[0]):  # a part a row does not read adds exact zeros
        merged, total = merged + weighted[part], total + weights[part]
    return merged / total[..., None]


def attend_with_lse(
    query: torch.Tensor,  # [B, H_kv, Q, D]
    keys: torch.Tensor,  # [B, H_kv, S, D]
    values: torch.Tensor,  # [B, H_kv, S, D]
    mask: torch.Tensor | None,  # additive, broadcast to [B, H_kv, Q, S], or None
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention output [B, H_kv, Q, D] and each query's log-sum-exp of its scores [B, H_kv, Q].

    On the CPU the fused flash kernel (one pass, never a [Q, S] score matrix per head in memory); on CUDA
    FlexAttention compiled to one Triton kernel per pass (``flex_attention.py``); elsewhere matmuls and a
    softmax."""
    if FLASH_CPU is not None and query.device.type == "cpu":
        return FLASH_CPU(query, keys, values, attn_mask=mask, scale=scale)
    if query.device.type == "cuda":
        return flex_with_lse(query, keys, values, mask, scale)
    out, lse = _attend_matmul(query, keys, values, mask, scale)
    return out.to(query.dtype), lse


def _attend_matmul(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend_with_lse`` by matmuls and a softmax, output in float32 (devices without the fused kernel)."""
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), values.float()), lse
