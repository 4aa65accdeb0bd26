"""A batched decode step over shared segments and private rows equals each sequence's own forward."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS, acting_adapter, tiny_model
from test_weights import tiny_in
from transformers.cache_utils import DynamicCache

from pc_rag.kv import SpanKV, kv_shape
from pc_rag.runtime.arena import PrivateArena
from pc_rag.runtime.batch_step import BatchDecodeStep, SharedRead
from pc_rag.runtime.shared_pool import SegmentKey, SharedKVPool
from pc_rag.runtime.static_batch_step import StaticBatchStep
from pc_rag.weights import KERNEL_ROWS

DESCRIBED = ["llama", "llama3-scaled", "mistral", "qwen2", "qwen3"]
TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2, "int8": 5e-2, "int4": 5e-2}


def _kv(g: torch.Generator, model, length: int, dtype: torch.dtype) -> SpanKV:
    layers, heads, dim = kv_shape(model)
    keys, values = torch.randn(2, layers, heads, length, dim, generator=g).to(dtype)
    return SpanKV(keys, values, torch.arange(length))


class _Batch:
    """Rows reading a 70-token segment (all), a 20-token one (rows 1 and 3), and private KV of their own."""

    def __init__(self, model, dtype: torch.dtype, rows: int = 4, all_read_both: bool = False) -> None:
        g = torch.Generator().manual_seed(0)
        layers, heads, dim = kv_shape(model)
        self.pool = SharedKVPool(layers, heads, dim, chunks=4, dtype=dtype)
        self.arena = PrivateArena(layers, heads, dim, rows=rows + 1, capacity=8, dtype=dtype)
        common, module = _kv(g, model, 70, dtype), _kv(g, model, 20, dtype)
        self.segments = [
            self.pool.acquire(SegmentKey("test", tuple(range(70)), tuple(range(70))), common),
            self.pool.acquire(SegmentKey("test", tuple(range(20)), tuple(range(70, 90))), module),
        ]
        self.readers = [list(range(rows)), list(range(rows)) if all_read_both else [r for r in (1, 3) if r < rows]]
        lengths = [5 + 3 * r for r in range(rows)]
        if rows > 4:  # a long row: the batch reads more private keys than a short row alone does
            lengths[-1] = 100
        self.private = [_kv(g, model, n, dtype) for n in lengths]
        for kv in self.private:
            self.arena.admit(kv.keys, kv.values)
        self.caches = []
        for r, kv in enumerate(self.private):  # the reference: each row's KV duplicated in one plain cache
            parts = [
                self.pool.view(s, slice(None)) for s, rs in zip(self.segments, self.readers, strict=True) if r in rs
            ]
            keys = torch.cat([p[0] for p in parts] + [kv.keys], dim=2)
            values = torch.cat([p[1] for p in parts] + [kv.values], dim=2)
            self.caches.append(
                DynamicCache(ddp_cache_data=[(k[None], v[None]) for k, v in zip(keys, values, strict=True)])
            )
        self.positions = torch.tensor([100 + 7 * r for r in range(rows)])

    def reads(self) -> list[SharedRead]:
        return [SharedRead(s, torch.tensor(rs)) for s, rs in zip(self.segments, self.readers, strict=True) if rs]


@pytest.mark.parametrize("dtype", sorted(TOLERANCE))
@pytest.mark.parametrize("arch", DESCRIBED)
def test_each_row_equals_its_own_forward_over_duplicated_kv(tokenizer, arch: str, dtype: str) -> None:
    lm = tiny_in(arch, dtype, tokenizer)
    step = BatchDecodeStep.of(lm.model)
    assert step is not None
    batch = _Batch(lm.model, lm.model.dtype)
    tokens = torch.tensor([5, 77, 301, 9])
    with torch.inference_mode():
        for i in range(3):
            logits = step(tokens, batch.positions + i, batch.arena, batch.pool, batch.reads())
            for r, cache in enumerate(batch.caches):
                plain = lm.model(
                    input_ids=tokens[r].view(1, 1), position_ids=(batch.positions[r] + i).view(1, 1),
                    past_key_values=cache, use_cache=True,
                ).logits[0, -1]  # fmt: skip
                error = (logits[r].float() - plain.float()).abs().max() / plain.float().abs().max()
                assert error < TOLERANCE[dtype], f"row {r}, step {i}: relative error {error:.1e}"
            tokens = logits.argmax(-1)
    for r, cache in enumerate(batch.caches):  # the new tokens' KV went to each row's private part
        n = batch.private[r].length
        own = batch.arena.keys[:, r, :, n : n + 3]
        # bfloat16: the reference rounds its attention to bfloat16 where ours stays in float32 (0.1-0.2 apart)
        close = {"rtol": 1e-5, "atol": 1e-5} if dtype == "float32" else {"rtol": 5e-2, "atol": 2e-1}
        torch.testing.assert_close(own, torch.stack([layer.keys[0, :, -3:] for layer in cache.layers]), **close)
        assert int(batch.arena.lengths[r]) == n + 3


def test_segments_stored_back_to_back_and_read_by_the_same_rows_attend_as_one_masked_run(tokenizer) -> None:
    lm = tiny_model("llama", tokenizer)
    step = BatchDecodeStep.of(lm.model)
    batch = _Batch(lm.model, torch.float32, all_read_both=True)
    assert batch.segments[1].follows(batch.segments[0])  # 70 tokens in two chunks, padding, then 20 tokens
    tokens = torch.tensor([5, 77, 301, 9])
    with torch.inference_mode():
        logits = step(tokens, batch.positions, batch.arena, batch.pool, batch.reads())
        for r, cache in enumerate(batch.caches):
            plain = lm.model(
                input_ids=tokens[r].view(1, 1), position_ids=batch.positions[r].view(1, 1), past_key_values=cache
            ).logits[0, -1]
            torch.testing.assert_close(logits[r], plain, rtol=1e-5, atol=1e-5)


def test_a_finished_row_is_refilled_by_the_last_and_decoding_goes_on(tokenizer) -> None:
    lm = tiny_model("llama", tokenizer)
    step = BatchDecodeStep.of(lm.model)
    batch = _Batch(lm.model, torch.float32)
    tokens = torch.tensor([5, 77, 301, 9])
    with torch.inference_mode():
        before = step(tokens, batch.positions, batch.arena, batch.pool, batch.reads())
        for r, cache in enumerate(batch.caches):  # the references take the same first step
            lm.model(input_ids=tokens[r].view(1, 1), position_ids=batch.positions[r].view(1, 1), past_key_values=cache)
        assert batch.arena.retire(1) == 3  # row 3 moves into row 1
        batch.readers = [[0, 1, 2], [1]]  # the old row 3 reads both segments, now as row 1
        order = [0, 3, 2]
        again = step(before.argmax(-1)[order], batch.positions[order] + 1, batch.arena, batch.pool, batch.reads())
        for row, old in enumerate(order):
            plain = lm.model(
                input_ids=before.argmax(-1)[old].view(1, 1), position_ids=(batch.positions[old] + 1).view(1, 1),
                past_key_values=batch.caches[old], use_cache=False,
            ).logits[0, -1]  # fmt: skip
            torch.testing.assert_close(again[row], plain, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", sorted(TOLERANCE))
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_row_gets_the_same_bits_alone_as_in_any_batch(tokenizer, arch: str, dtype: str) -> None:
    """Greedy answers must not depend on who else is decoding: each row's logits are bitwise those of the row
    decoded alone, whatever the batch size and whatever other segments the other rows read. int8 and int4 rows
    past ``KERNEL_ROWS`` take the fused kernels ``KERNEL_ROWS`` rows at a time, as a row alone does."""
    lm = tiny_in(arch, dtype, tokenizer)
    step = BatchDecodeStep.of(lm.model)
    rows = 2 * KERNEL_ROWS + 1
    alone, crowd = _Batch(lm.model, lm.model.dtype, rows=1), _Batch(lm.model, lm.model.dtype, rows=rows)
    tokens = torch.tensor([5, 77, 301, 9, 40, 12, 250, 3, 66])[:rows]
    with torch.inference_mode():
        for i in range(3):
            one = step(tokens[:1], alone.positions + i, alone.arena, alone.pool, alone.reads())
            many = step(tokens, crowd.positions + i, crowd.arena, crowd.pool, crowd.reads()[::-1])
            assert torch.equal(one[0], many[0]), f"step {i}"
            tokens = many.argmax(-1)


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_a_row_under_an_adapter_gets_the_same_bits_alone_as_in_a_batch(tokenizer, dtype: str) -> None:
    """``fast`` applies a merged splice adapter to q_proj and o_proj: the step adds its low-rank term to the int4
    kernels' rows (float32: the merged weight), and a row still gets its bits alone, in a batch of any size."""
    lm = tiny_in("llama", dtype, tokenizer)
    adapter = acting_adapter(lm.model)
    adapter.attach(merged=True)
    step = BatchDecodeStep.of(lm.model)
    rows = 2 * KERNEL_ROWS + 1
    alone, crowd = _Batch(lm.model, lm.model.dtype, rows=1), _Batch(lm.model, lm.model.dtype, rows=rows)
    tokens = torch.tensor([5, 77, 301, 9, 40, 12, 250, 3, 66])[:rows]
    try:
        with torch.inference_mode(), adapter.applied():
            for i in range(3):
                one = step(tokens[:1], alone.positions + i, alone.arena, alone.pool, alone.reads())
                many = step(tokens, crowd.positions + i, crowd.arena, crowd.pool, crowd.reads()[::-1])
                assert torch.equal(one[0], many[0]), f"step {i}"
                tokens = many.argmax(-1)
    finally:
        adapter.detach()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_over_some_rows_gives_them_the_bits_of_the_whole_arena_step(tokenizer, dtype: str) -> None:
    """Rows under different contexts (an adapter applied to some) decode in steps of their own, over the rows
    ``rows`` names: each row gets the bits of the step over every live row, and only its own KV advances."""
    lm = tiny_in("llama", dtype, tokenizer)
    step = BatchDecodeStep.of(lm.model)
    assert step is not None
    whole, split = _Batch(lm.model, lm.model.dtype, rows=5), _Batch(lm.model, lm.model.dtype, rows=5)
    tokens = torch.tensor([5, 77, 301, 9, 40])
    # rows out of arena order; each part's rows read the two segments as differently as in the whole step (rows
    # that all read both would attend to them as one run: equal to fp32 rounding only, see ``batch_step._runs``)
    parts = [[1, 0], [4, 2, 3]]
    with torch.inference_mode():
        for i in range(3):
            every = step(tokens, whole.positions + i, whole.arena, whole.pool, whole.reads())
            for rows in parts:
                reads = [
                    SharedRead(s, torch.tensor(at))
                    for s, readers in zip(split.segments, split.readers, strict=True)
                    if (at := [index for index, r in enumerate(rows) if r in readers])
                ]
                some = step(tokens[rows], split.positions[rows] + i, split.arena, split.pool, reads, rows)
                assert torch.equal(some, every[rows]), f"step {i}, rows {rows}"
            tokens = every.argmax(-1)
    assert split.arena.host_lengths == whole.arena.host_lengths
    assert torch.equal(split.arena.lengths, whole.arena.lengths)
    live = whole.arena.active  # the rows past it hold whatever memory the arena grew into
    assert split.arena.active == live
    assert torch.equal(split.arena.keys[:, :live], whole.arena.keys[:, :live])
    assert torch.equal(split.arena.values[:, :live], whole.arena.values[:, :live])


@pytest.mark.parametrize("arch", sorted(set(TINY_CONFIGS) - set(DESCRIBED)))
def test_models_it_does_not_describe_get_no_step(tokenizer, arch: str) -> None:
    assert BatchDecodeStep.of(tiny_model(arch, tokenizer).model) is None


def _finite(batch: _Batch) -> None:
    """Replace NaN and infinity in the arena's and pool's unwritten slots (fresh memory in a long test run may hold
    them): the static step reads masked slots too, and ``0 * NaN`` is NaN, as its caller guarantees they are not."""
    for tensor in (batch.arena.keys, batch.arena.values, batch.pool.keys, batch.pool.values):
        tensor.nan_to_num_(0.0, 0.0, 0.0)


def _static_inputs(batch: _Batch, rows: int) -> tuple[torch.Tensor, ...]:
    """The static step's device inputs for ``_Batch``: lengths and rows, and each row's visible pool slots."""
    slots = batch.pool.keys.shape[2]
    visible = torch.zeros(rows, slots, dtype=torch.bool)
    for segment, readers in zip(batch.segments, batch.readers, strict=True):
        for r in readers:
            visible[r, segment.start : segment.end] = True
    return batch.arena.lengths[:rows].clone(), torch.arange(rows), visible


@pytest.mark.parametrize("chunk", [32, 10_000])  # split-KV parts merged by log-sum-exp, or one part
def test_the_static_step_equals_the_batched_step(tokenizer, chunk: int) -> None:
    """``StaticBatchStep`` (device inputs only, capturable per batch-size bucket) gives the logits and the KV of
    ``BatchDecodeStep`` over three steps."""
    lm = tiny_in("llama", "float32", tokenizer)
    step, static = BatchDecodeStep.of(lm.model), StaticBatchStep(lm.model, chunk=chunk)
    assert step is not None
    ours, theirs = _Batch(lm.model, torch.float32), _Batch(lm.model, torch.float32)
    ours.arena.reserve(4)
    _finite(ours)
    tokens = torch.tensor([5, 77, 301, 9])
    with torch.inference_mode():
        for i in range(3):
            lengths, rows, visible = _static_inputs(ours, 4)
            mine = static(tokens, ours.positions + i, lengths, rows, ours.pool.keys, ours.pool.values, visible,
                          ours.arena.keys, ours.arena.values)  # fmt: skip
            ours.arena.advance(4)
            reference = step(tokens, theirs.positions + i, theirs.arena, theirs.pool, theirs.reads())
            torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
            tokens = reference.argmax(-1)
    n = int(theirs.arena.lengths.max())
    torch.testing.assert_close(ours.arena.keys[:, :4, :, :n], theirs.arena.keys[:, :4, :, :n], rtol=1e-5, atol=1e-5)


def test_the_static_step_compiles_whole_and_once_for_any_lengths(tokenizer) -> None:
    """The nearest CPU proxy for "capturable": ``torch.compile(fullgraph=True)`` traces the static step with no graph
    break (AOT autograd functionalizes its KV writes), and new lengths and visibility reuse the one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    lm = tiny_in("llama", "float32", tokenizer)
    static = StaticBatchStep(lm.model, chunk=32)
    batch = _Batch(lm.model, torch.float32)
    batch.arena.reserve(4)
    _finite(batch)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(static.__call__, backend=counter, fullgraph=True, dynamic=False)
    tokens = torch.tensor([5, 77, 301, 9])
    with torch.inference_mode():
        for i in range(2):
            lengths, rows, visible = _static_inputs(batch, 4)
            args = (tokens, batch.positions + i, lengths, rows, batch.pool.keys, batch.pool.values, visible)
            expected = static(*args, batch.arena.keys.clone(), batch.arena.values.clone())
            torch.testing.assert_close(compiled(*args, batch.arena.keys, batch.arena.values), expected)
            batch.arena.advance(4)
    assert counter.frame_count == 1, "recompiled for new lengths"
