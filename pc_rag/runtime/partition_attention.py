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


@dataclass(frozen=True)
class PartitionPlan:
    """Where each run's queries come from and where its outputs go: the same in every layer, so built once per
    decode step (from the readers on the host) and not per layer.

    The queries are the step's [H_kv, B * n_rep] (row-major, then the query heads of a KV head); run r reads
    ``gather[r]`` of them (its readers', then its first query repeated up to a multiple of ``ROW_MULTIPLE``), and its
    first ``counts[r]`` outputs go to ``scatter``'s slice for it: part ``p`` of row ``b`` at ``p * B * n_rep + b *
    n_rep + k``. A row's parts are its private part (0), then the runs it reads, in the order given (pool order)."""

    parts: int  # the most parts any row merges
    gather: tuple[torch.Tensor, ...]  # per run: [padded_rows(n * n_rep)] long
    counts: tuple[int, ...]  # per run: n * n_rep
    scatter: torch.Tensor  # [sum(counts)] long

    @classmethod
    def of(
        cls, readers: Sequence[Sequence[int]], batch: int, n_rep: int, device: torch.device | str = "cpu"
    ) -> PartitionPlan:
        """The plan for runs read by ``readers`` (distinct rows in increasing order, per run, in pool order)."""
        seen = [1] * batch  # parts each row has so far: its private part
        gather, counts, scatter = [], [], []
        for rows in readers:
            queries = [row * n_rep + k for row in rows for k in range(n_rep)]
            gather.append(queries + queries[:1] * (padded_rows(len(queries)) - len(queries)))
            counts.append(len(queries))
            for row in rows:
                scatter.extend(seen[row] * batch * n_rep + row * n_rep + k for k in range(n_rep))
                seen[row] += 1
        indices = [torch.tensor(ids, dtype=torch.long, device=device) for ids in [*gather, scatter]]
        return cls(max(seen), tuple(indices[:-1]), tuple(counts), indices[-1])


def partition_attention(
    query: torch.Tensor,  # [B, H, D]: one new token per sequence, after RoPE
    runs: Sequence[SharedRun],
    private_keys: torch.Tensor,  # [B, H_kv, P, D]
    private_values: torch.Tensor,  # [B, H_kv, P, D]
    private: torch.Tensor,  # [B, P] additive (``private_mask``): each row sees at least one private key
    scale: float,
    plan: PartitionPlan | None = None,  # of these runs' readers (default: built here, reading them to the host)
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
    if plan is None:
        plan = PartitionPlan.of([run.readers.tolist() for run in runs], batch, n_rep, query.device)
    queries = grouped.transpose(0, 1).reshape(kv_heads, batch * n_rep, dim)  # [H_kv, B * n_rep, D]
    outs, lses = [], []
    for run, gather, count in zip(runs, plan.gather, plan.counts, strict=True):
        mask = run.mask[None, None, None, :] if run.mask is not None else None
        o, o_lse = attend_with_lse(queries.index_select(1, gather)[None], run.keys[None], run.values[None], mask, scale)
        outs.append(o[0, :, :count])
        lses.append(o_lse[0, :, :count])
    # every row's parts [H_kv, parts, B * n_rep]: a part a row does not have is output 0, log-sum-exp -inf, a part
    # of weight exactly 0 after its own, so a row merges to the same bits whatever the other rows read
    width = batch * n_rep
    parts_out = query.new_zeros((kv_heads, plan.parts * width, dim), dtype=torch.float32)
    parts_lse = query.new_full((kv_heads, plan.parts * width), float("-inf"), dtype=torch.float32)
    parts_out[:, :width] = out.transpose(0, 1).reshape(kv_heads, width, dim)
    parts_lse[:, :width] = lse.transpose(0, 1).reshape(kv_heads, width)
    parts_out.index_copy_(1, plan.scatter, torch.cat(outs, 1).float())
    parts_lse.index_copy_(1, plan.scatter, torch.cat(lses, 1).float())
    by_part = (parts_out.view(kv_heads, plan.parts, width, dim), parts_lse.view(kv_heads, plan.parts, width))
    merged = _merge(by_part[0].transpose(0, 1), by_part[1].transpose(0, 1))  # [H_kv, B * n_rep, D]
    return merged.view(kv_heads, batch, n_rep, dim).transpose(0, 1).reshape(batch, heads, dim).to(query.dtype)


def _padded(queries: torch.Tensor) -> torch.Tensor:
    """``queries`` [.., H_kv, Q, D] with its first query repeated up to ``padded_rows(Q)`` (outputs dropped after)."""
    pad = padded_rows(queries.shape[2]) - queries.shape[2]
    return torch.cat([queries, queries[:, :, :1].expand(-1, -1, pad, -1)], 2) if pad else queries


def _merge(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Parts ``out`` [T, ..., D] merged into [..., D], each weighted by its share of its row's softmax mass (the
    parts' log-sum-exp ``lse`` [T, ...]), added in part order.

    Elementwise operations only, so an element's bits depend on its own row's values, not on where the row sits
    or how many rows there are: max is exact, subtraction, products, sums in part order and the division are
    correctly rounded in any layout, and ``torch.exp`` gives the same bits in its vector loop and its scalar
    tail (measured on the AVX-512 and the AVX2 kernels). ``torch.softmax`` over a non-last dimension does not:
    with it a row's weights depended on the batch size, by 1e-8 (then 1e-6 in the logits of
    ``test_a_row_gets_the_same_bits_alone_as_in_any_batch``)."""
    weights = torch.exp(lse - lse.amax(0))  # the private part sees a key, so each row's max is finite
    weighted = out * weights[..., None]
    merged, total = weighted[0], weights[0]
    for part in range(1, out.shape[0]):  # parts a row does not have (after its own) add exact zeros
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
