"""One decode step for many sequences at once: the weights are read once for the batch, shared KV once per step.

Each live row of a ``PrivateArena`` is a sequence; it attends to the shared segments it reads (in a
``SharedKVPool``) and to its private row, through ``partition_attention``. The layers are written out as in
``DecodeStep`` (same norms, rotary and projections of transformers' modules, in the same order and dtypes), with
B rows where that step has one; models it does not describe get ``None`` from ``BatchDecodeStep.of``. This
module knows nothing about requests or scheduling.

A row's logits do not depend on who else decodes: alone or at any place in any batch, in float32 and bfloat16,
a row gets the same bits, on AVX-512 and on AVX2-only CPUs, at 1 to 16 threads (matmul rows padded to
``partition_attention.ROW_MULTIPLE``, private capacities in steps of ``CAPACITY_STEP``, and a merge of
elementwise operations: ``partition_attention._merge``). Two exceptions: rows that read different segments can
split a run (``_runs``: then equal to fp32 rounding). int8/int4 models take their fused kernels ``KERNEL_ROWS``
rows at a time at any batch size (a row's bits depend only on the call's row count, which is the same alone), so
they keep the rule too. On the 2-core Xeon VM (no bfloat16 arithmetic: the dense copy multiplies in float32) the
kernels in groups of 4 took 57 / 97 / 186 ms for the projections of 8 / 16 / 32 rows against the dense bfloat16
copy's 109 / 159 / 181 (``examples/kernel_rows_ab.py``, ``examples/results/kernel_rows_ab_xeon.json``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from pc_rag.runtime.arena import CAPACITY_STEP, PrivateArena
from pc_rag.runtime.decode_step import FusedLayer, built_once, by_kernel_rows, rms_norm
from pc_rag.runtime.partition_attention import (
    PartitionPlan,
    SharedRun,
    padded_rows,
    partition_attention,
    private_mask,
)
from pc_rag.runtime.shared_pool import Segment, SharedKVPool


@dataclass(frozen=True)
class SharedRead:
    """A shared segment and the step's rows that attend to it (arena rows; with ``rows`` given to the step, indices
    into those rows)."""

    segment: Segment
    rows: torch.Tensor  # [n] long, distinct
    row_ids: tuple[int, ...] | None = None  # the same rows on the host (compared without a device sync)

    def same_rows(self, other: SharedRead) -> bool:
        if self.row_ids is not None and other.row_ids is not None:
            return self.row_ids == other.row_ids
        return torch.equal(self.rows, other.rows)


class BatchDecodeStep:
    """``step(tokens, positions, arena, pool, reads, rows)``: next-token logits [B, V] of the arena's B live rows, or
    of the B rows ``rows`` names (requests whose steps run under another context decode in a step of their own)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self._decoder = model.get_decoder()
        self._layers = [_BatchLayer(layer) for layer in self._decoder.layers]

    @classmethod
    def of(cls, model: PreTrainedModel) -> BatchDecodeStep | None:
        """The model's step, built once per model; None when it would not equal the model's forward."""
        return built_once(cls, model)

    @torch.inference_mode()
    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, arena: PrivateArena, pool: SharedKVPool | None,
        reads: Sequence[SharedRead] = (), rows: Sequence[int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Row b's token ``tokens[b]`` at ``positions[b]`` (both [B] long) is appended to its private KV; returns
        the logits [B, V] after it. The rows are the arena's B = ``arena.active`` live rows, or the distinct live
        rows ``rows`` (their private KV is then gathered per layer: a copy the whole-arena step does not make)."""
        batch = arena.active if rows is None else len(rows)
        assert tokens.shape == positions.shape == (batch,), "one token per row"
        arena.reserve(1)
        decoder = self._decoder
        padded = padded_rows(batch)
        if rows is None:
            live = torch.arange(batch, device=tokens.device)
            host_lengths = arena.host_lengths[:batch]
        else:
            live = torch.tensor(list(rows), dtype=torch.long, device=tokens.device)
            host_lengths = [arena.host_lengths[r] for r in rows]
        steps = torch.arange(batch, device=tokens.device)
        index = torch.cat([steps, steps.new_zeros(padded - batch)])  # padding rows repeat row 0, never written back
        x = decoder.embed_tokens(tokens[index, None])  # [padded, 1, hidden]
        rotary = decoder.rotary_emb(x, positions[index, None])
        lengths = arena.lengths[:batch] if rows is None else arena.lengths[live]
        # the private keys to read: the longest row's, rounded up (any multiple of CAPACITY_STEP gives the same bits)
        longest = max(host_lengths)  # host bookkeeping: no device sync
        private = min(arena.capacity, -(-(longest + 1) // CAPACITY_STEP) * CAPACITY_STEP)
        groups = _runs(reads) if pool is not None else []
        mask = private_mask(lengths + 1, private, x.dtype)  # after this step's token, the same in every layer
        n_rep = self._decoder.layers[0].self_attn.num_key_value_groups  # query heads per KV head
        plan = PartitionPlan.of([run.reader_ids for run in groups], batch, n_rep, tokens.device) if groups else None
        for layer_index, layer in enumerate(self._layers):
            runs = [SharedRun(*pool.span(g.start, g.end, layer_index), g.readers, g.mask) for g in groups]
            keys, values = arena.keys[layer_index], arena.values[layer_index]
            x = layer(x, rotary, keys, values, live, lengths, runs, mask, plan, whole=rows is None)
        if rows is None:
            arena.advance(batch)
        else:
            arena.advance_rows(list(rows), live)
        fused = x.dtype == torch.bfloat16  # as in the layers: an int8 head KERNEL_ROWS rows at a time
        return by_kernel_rows(self._model.lm_head, rms_norm(decoder.norm, x), fused)[:batch, -1]


@dataclass(frozen=True)
class _Run:
    """Pool tokens ``start:end`` read by the step's rows ``readers`` (``reader_ids`` on the host); ``mask`` hides the
    padding between segments stored back to back."""

    start: int
    end: int
    readers: torch.Tensor
    reader_ids: list[int]
    mask: torch.Tensor | None


def _runs(reads: Sequence[SharedRead]) -> list[_Run]:
    """Shared reads as attention runs in pool order: segments stored back to back and read by the same rows form
    one run, the padding between them masked.

    A row's parts then merge in pool order, whoever else reads: alone or in a batch whose rows read the same
    segments, a row gets the same bits (rows that read different segments can split a run: then equal to fp32
    rounding)."""
    groups: list[tuple[list[Segment], SharedRead]] = []
    for read in sorted(reads, key=lambda r: r.segment.start):
        last = groups[-1] if groups else None
        if last is not None and read.segment.follows(last[0][-1]) and read.same_rows(last[1]):
            last[0].append(read.segment)
        else:
            groups.append(([read.segment], read))
    runs = []
    for segments, first in groups:
        readers = first.rows
        start, end = segments[0].start, segments[-1].end
        mask = None
        if len(segments) > 1:
            mask = torch.full((end - start,), float("-inf"), device=readers.device)
            for segment in segments:
                mask[segment.start - start : segment.end - start] = 0
        ids = list(first.row_ids) if first.row_ids is not None else first.rows.tolist()
        runs.append(_Run(start, end, readers, ids, mask))
    return runs


class _BatchLayer(FusedLayer):
    """One decoder layer over B rows; quantized layers run their fused kernels ``KERNEL_ROWS`` rows at a time."""

    def __call__(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor, values: torch.Tensor,
        rows: torch.Tensor, lengths: torch.Tensor, runs: list[SharedRun], private: torch.Tensor,
        plan: PartitionPlan | None, whole: bool = True,
    ) -> torch.Tensor:  # fmt: skip
        """``x`` [padded, 1, hidden] -> [padded, 1, hidden] (rows past B pad the matmuls: see
        ``partition_attention.ROW_MULTIPLE``); writes each row's new key and value into ``keys``/``values``
        [arena rows, H_kv, capacity, D] at arena row ``rows[b]``, entry ``lengths[b]``, and attends to the entries
        of each row ``private`` (its additive mask [B, P], ``private_mask``) lets it see. ``whole``: ``rows`` are
        the arena's first B rows, read in place. ``plan``: the runs' ``PartitionPlan`` (built once per step)."""
        attn = self.layer.self_attn
        padded, batch = x.shape[0], rows.shape[0]
        fused = x.dtype == torch.bfloat16  # int8/int4 on their kernels (float32 and bfloat16 models have none)
        q, k, v = self.project(x, rotary, fused)  # [padded, H(_kv), 1, D]
        keys[rows, :, lengths] = k[:batch, :, 0]
        values[rows, :, lengths] = v[:batch, :, 0]
        capacity = private.shape[1]
        if whole:
            own_keys, own_values = keys[:batch, :, :capacity], values[:batch, :, :capacity]
        else:  # [B, H_kv, P, D] gathered: the same entries, so the same bits as read in place
            own_keys, own_values = keys[rows, :, :capacity], values[rows, :, :capacity]
        out = partition_attention(q[:batch, :, 0], runs, own_keys, own_values, private, attn.scaling, plan)
        if padded > batch:
            out = torch.cat([out, out[:1].expand(padded - batch, -1, -1)])  # [padded, H, D]
        return self.finish(x, out.reshape(padded, 1, -1), fused)
