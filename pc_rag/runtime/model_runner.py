"""One model runner under every plain forward: new tokens over a preallocated cache, and the decode step.

Every way of serving (PML prompts, RAG answers, the full-prefill baseline) ends in the same two forwards: the
tokens a request computes at query time, written after its spliced cache, and one decode step per generated
token. ``ModelRunner`` runs both for one sequence. On the CPU it runs them as they ran before (transformers'
forward for new tokens, the fused ``DecodeStep``), so CPU figures and bits do not change. On CUDA, for the
Llama-style models ``DecodeStep`` describes, it runs a **static-shape** forward (``StaticForward``): the cached
length and the last real token's index are device tensors the step reads, the new tokens are padded to a
bucket, attention runs over the whole buffer under a mask, and keys and values are written with
``index_copy_``. Nothing in it depends on a host value, so it is captured once per (buffer, bucket) as a CUDA
graph and replayed (``GraphedForward``): a request launches a handful of graphs instead of ~1,000 kernels.

Rules of the buffer: keys are stored after RoPE at absolute positions; slots at or after the cached length
hold garbage that no real query sees (the mask), and the padded tokens of a bucket write their garbage there.

This module knows nothing about PML, chunks, adapters or sampling: it receives token ids, positions and a
``KVBuffer``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel

from pc_rag.assemble import forward_new_tokens
from pc_rag.kv import BufferCache, KVBuffer
from pc_rag.runtime.answer_phrases import AnswerPhrases
from pc_rag.runtime.decode_step import STEP_ROWS, DecodeStep, FusedLayer, built_once, rms_norm
from pc_rag.runtime.draft_policy import KeepRates, StepCosts
from pc_rag.runtime.model_call import PLAIN, ModelCall
from pc_rag.weights import KERNEL_ROWS, QuantizedLinear

logger = logging.getLogger(__name__)

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
"""Padded new-token counts a graph is captured for; longer forwards are compute-bound and run eagerly."""
MAX_GRAPHS = 64
"""Captured graphs kept per model (least recently used dropped): each pins its buffer's tensors and a little
memory; a buffer's first use captures one per bucket that fits it (7 at most)."""
CALL_KINDS = ("static", "fallback", "long", "captures")
"""What ``ModelRunner.calls`` counts: calls on the static-shape path (graph replays on CUDA), calls a bucket held
but that ran eagerly (no static path, or a buffer too small), forwards longer than every bucket (eager by design),
and bucket captures."""


def bucket_for(count: int, buckets: Sequence[int] = PREFILL_BUCKETS) -> int | None:
    """The smallest bucket holding ``count`` new tokens (1 is its own bucket: the decode step); None if none."""
    if count == 1:
        return 1
    return next((b for b in buckets if b >= count), None)


SDPA_BACKENDS = {
    "cuda": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "cpu": [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH],
}
"""The static forward's attention kernels, pinned so that a capture records the kernel that was measured: on CUDA
memory-efficient attention (it takes the boolean mask; flash does not, cuDNN re-plans per shape), math only where
it cannot run (slower, not a crash in the one GPU call); the CPU keeps its own choice (flash with a mask)."""


def padded_count(count: int) -> int:
    """The slots a forward of ``count`` new tokens needs in its buffer: its bucket, or ``count`` beyond every bucket
    (size buffers with it, or a cached request just under a capacity runs eagerly)."""
    return bucket_for(count) or count


class StaticForward:
    """``T`` tokens after ``length`` cached ones in a full-capacity buffer, with no shape that depends on them.

    ``__call__(tokens [1, T], positions [1, T], length [1], last [1], keys, values)`` writes the tokens' keys
    and values into ``keys``/``values`` [L, 1, H_kv, C, D] at slots ``length + t`` and returns the logits [V]
    of token ``last``. Query ``t`` sees slots ``<= length + t``; the query heads are folded onto their KV head
    (query head h = g * n_rep + r reads KV head g), so the cache is read in place, never repeated.
    The caller guarantees ``length + T <= C`` and that no slot holds NaN or infinity: a masked slot enters the
    attention's ``P @ V`` with weight 0, and ``0 * NaN`` is NaN.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self._model = model
        self._decoder = model.get_decoder()
        self._layers = [FusedLayer(layer) for layer in self._decoder.layers]

    @classmethod
    def of(cls, model: PreTrainedModel) -> StaticForward | None:
        """The model's static forward, built once; None for models ``DecodeStep`` does not describe."""
        return built_once(cls, model)

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        length: torch.Tensor,
        last: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        decoder = self._decoder
        count, capacity = tokens.shape[1], keys.shape[-2]
        slots = length + torch.arange(count, device=tokens.device)  # [T]
        visible = torch.arange(capacity, device=tokens.device)[None, :] <= slots[:, None]  # [T, C]
        x = decoder.embed_tokens(tokens)  # [1, T, hidden]
        rotary = decoder.rotary_emb(x, positions)
        with sdpa_kernel(SDPA_BACKENDS["cuda" if keys.is_cuda else "cpu"]):
            for index, fused in enumerate(self._layers):
                x = self._layer(fused, x, rotary, keys[index], values[index], slots, visible)
        hidden = rms_norm(decoder.norm, x)[0].index_select(0, last)  # [1, hidden]
        return self._model.lm_head(hidden)[0]

    @staticmethod
    def _layer(
        fused: FusedLayer,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        keys: torch.Tensor,
        values: torch.Tensor,
        slots: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """One decoder layer on ``x`` [1, T, hidden]; writes its keys and values into the layer's [1, H_kv, C, D]."""
        count = x.shape[1]
        small = count <= KERNEL_ROWS  # a quantized fused kernel takes at most KERNEL_ROWS rows
        q, k, v = fused.project(x, rotary, small)  # [1, H, T, D], [1, H_kv, T, D]
        keys[0].index_copy_(1, slots, k[0])
        values[0].index_copy_(1, slots, v[0])
        kv_heads, head_dim = keys.shape[1], q.shape[-1]
        n_rep = q.shape[1] // kv_heads
        folded = q.reshape(1, kv_heads, n_rep * count, head_dim)  # rows (r, t), r major
        mask = visible.repeat(n_rep, 1)[None, None]  # [1, 1, n_rep * T, C]
        scale = fused.layer.self_attn.scaling
        out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
        out = out.reshape(1, kv_heads * n_rep, count, head_dim).transpose(1, 2).reshape(1, count, -1)
        return fused.finish(x, out, small)


def capture_length(capacity: int, bucket: int) -> int:
    """The cached length a capture's forwards run at: the buffer's last ``bucket`` slots, which no real query reads.

    A capture runs the forward (its warm-up writes keys and values, the graph replays write them again), so it must
    not run at length 0: that would overwrite the first cached tokens of the request that triggers it. A request
    uses a bucket only when ``length + bucket <= capacity``, so ``capacity - bucket`` is at or after its cached
    length, and those slots are garbage the mask hides until a real token writes them."""
    assert bucket <= capacity, f"bucket {bucket} does not fit a buffer of {capacity} slots"
    return capacity - bucket


class BucketForward:
    """A ``StaticForward`` of one bucket over one buffer's tensors, run eagerly: the path CUDA captures as a graph.

    Inputs live in one device tensor (tokens, positions, length, last) that ``run`` fills, as a graph's must. On
    the CPU this is the bookkeeping twin of ``GraphedForward``: the same inputs, the same warm-up at
    ``capture_length``, the same forward, no graph. It holds the buffer's tensors (not the mutable ``KVBuffer``),
    so a regrown buffer cannot leave it writing freed memory."""

    def __init__(self, forward: StaticForward, keys: torch.Tensor, values: torch.Tensor, bucket: int) -> None:
        self.forward, self.keys, self.values, self.bucket = forward, keys, values, bucket
        device = keys.device
        self.inputs = torch.zeros(2 * bucket + 2, dtype=torch.long, device=device)
        self.tokens, self.positions = self.inputs[:bucket].view(1, bucket), self.inputs[bucket:-2].view(1, bucket)
        self.length, self.last = self.inputs[-2:-1], self.inputs[-1:]
        self.length.fill_(capture_length(keys.shape[-2], bucket))
        self.warm_up()

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.tokens, self.positions, self.length, self.last, self.keys, self.values)

    def warm_up(self) -> None:
        """One forward at ``capture_length`` (lazy inits, autotuning); it writes only the buffer's last slots."""
        self.logits = self.forward(*self.args)

    def stage(self, ids: Sequence[int], positions: Sequence[int], length: int) -> None:
        """Copy one request's inputs into ``inputs`` (padding: token 0 at the last real position)."""
        count = len(ids)
        assert 0 < count <= self.bucket and length + self.bucket <= self.keys.shape[-2]
        padded_ids = [*ids, *([0] * (self.bucket - count))]
        padded_positions = [*positions, *([positions[-1]] * (self.bucket - count))]
        staged = torch.tensor([*padded_ids, *padded_positions, length, count - 1])
        if self.inputs.device.type == "cuda":
            self.inputs.copy_(staged.pin_memory(), non_blocking=True)
        else:
            self.inputs.copy_(staged)

    def run(self, ids: Sequence[int], positions: Sequence[int], length: int) -> torch.Tensor:
        """The logits [V] of the last of ``ids`` at ``positions`` after ``length`` cached tokens."""
        self.stage(ids, positions, length)
        return self.forward(*self.args)


class GraphedForward(BucketForward):
    """A ``BucketForward`` captured as a CUDA graph; ``run`` replays it.

    The logits are a tensor the graph overwrites (copy them before the next replay if they must outlive it)."""

    def __init__(
        self, forward: StaticForward, keys: torch.Tensor, values: torch.Tensor, bucket: int, pool: Any
    ) -> None:
        self._pool = pool
        super().__init__(forward, keys, values, bucket)

    def warm_up(self) -> None:
        device = self.keys.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up outside the graph: lazy inits and autotuning happen here
            super().warm_up()
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self._pool):
            self.logits = self.forward(*self.args)

    def run(self, ids: Sequence[int], positions: Sequence[int], length: int) -> torch.Tensor:
        self.stage(ids, positions, length)
        self.graph.replay()
        return self.logits


class ModelRunner:
    """The forwards of one model: ``forward`` (new tokens after a spliced cache) and ``decode`` (one token).

    ``graphs``: capture and replay CUDA graphs (default: on when the model is on CUDA and ``StaticForward``
    describes it). ``static``: run the static-shape path where a graph would replay (default: ``graphs``);
    static without graphs is the CPU's bookkeeping mode (``enable_static``): every call takes the path CUDA
    captures, eagerly. Bucket forwards are keyed by the buffer's key and value addresses, its capacity and the
    bucket, and kept in an LRU of ``MAX_GRAPHS``. ``calls`` counts what each call took (``CALL_KINDS``).
    """

    def __init__(self, model: PreTrainedModel, graphs: bool | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self._static = StaticForward.of(model)
        self.graphs = (self.device.type == "cuda" and self._static is not None) if graphs is None else graphs
        if self.graphs and (self.device.type != "cuda" or self._static is None):
            msg = f"CUDA graphs need a CUDA model that StaticForward describes (device {self.device})"
            raise ValueError(msg)
        self.static = self.graphs
        self.calls: Counter[str] = Counter()
        self.step_costs = StepCosts()
        """Measured verify-step times by row count, for the draft policy (``runtime.draft_policy``)."""
        self.keep_rates = KeepRates()
        """Every request's kept drafts, pooled: the prior of a new request's draft policy."""
        self.answer_phrases: AnswerPhrases | None = None
        """The model's stock phrases, a second draft source (``runtime.answer_phrases``); set by ``rag.tuned``."""
        self._captured: OrderedDict[tuple[int, int, int, int], BucketForward] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._lock = threading.RLock()

    @classmethod
    def of(cls, model: PreTrainedModel) -> ModelRunner:
        """The model's runner, built once per model (for every model: one ``StaticForward`` does not describe
        runs eagerly)."""
        runner = built_once(cls, model, described_only=False)
        assert runner is not None
        return runner

    def enable_static(self) -> None:
        """Run the static-shape path without graphs (the CPU's bookkeeping mode: what CUDA would replay)."""
        if self._static is None:
            msg = f"{type(self.model).__name__} has no static forward: StaticForward does not describe it"
            raise ValueError(msg)
        self.static = True

    def take_calls(self) -> Counter[str]:
        """The call counts since the last take, and reset them."""
        with self._lock:
            calls, self.calls = self.calls, Counter()
        return calls

    @torch.inference_mode()
    def forward(
        self, buffer: KVBuffer, length: int, ids: Sequence[int], positions: Sequence[int]
    ) -> tuple[torch.Tensor, BufferCache]:
        """Run ``ids`` at ``positions`` after ``length`` cached tokens of ``buffer``; last logits [V] and the cache."""
        bucket = bucket_for(len(ids))
        if bucket is None:
            self._count("long")
            return forward_new_tokens(self.model, buffer, length, ids, positions)
        if not self.static or length + bucket > buffer.keys.shape[-2]:
            self._count("fallback")
            if self.static:
                logger.warning("eager fallback: %d cached + bucket %d > capacity %d", length, bucket,
                               buffer.keys.shape[-2])  # fmt: skip
            return forward_new_tokens(self.model, buffer, length, ids, positions)
        logits = self._bucket(buffer, bucket, length).run(ids, positions, length)
        self._count("static")
        return logits.clone(), buffer.cache(length + len(ids))

    @torch.inference_mode()
    def decode(self, token: int, position: int, cache: BufferCache) -> torch.Tensor:
        """The logits [V] after ``token`` at ``position``, written after the cache's tokens (the cache advances).
        Where ``rows_agree``, the token attends as a speculative step's row does (``verify_attention``: 2-5% slower
        per step than one exact call, measured at 1K and 4K), so that speculation equals plain decoding bit for bit."""
        if not self.static:
            return self._eager([token], position, cache, rows=1, bucketed=self.rows_agree)[0]
        length = cache.get_seq_length()
        buffer = cache.gathered(room=1)
        logits = self._bucket(buffer, 1, length).run([token], [position], length)
        for layer in cache.layers:
            layer.advance(1)
        self._count("static")
        return logits.clone()

    @torch.inference_mode()
    def verify(self, tokens: Sequence[int], position: int, cache: BufferCache, rows: int = STEP_ROWS) -> torch.Tensor:
        """The logits [T, V] after each of ``tokens`` (a fed token, then drafts; T <= ``rows`` <= ``STEP_ROWS``)
        from ``position``, all written after the cache's tokens (the cache advances by T; the caller crops rejected
        drafts). Every step of a speculative request runs here, drafts or not, in ``rows`` rows, its rows attending
        in one call (``verify_attention``): row t then equals the step of ``tokens[t]`` alone after ``tokens[:t]``
        in as many rows, bit for bit (``DecodeStep``), and in any number of rows where ``rows_agree``."""
        assert self.speculates, "verify runs the CPU's DecodeStep (CUDA graphs decode one token)"
        assert len(tokens) <= rows <= STEP_ROWS, f"{len(tokens)} tokens in a step of {rows} rows"
        return self._eager(tokens, position, cache, rows=rows, bucketed=True)

    def _eager(
        self, tokens: Sequence[int], position: int, cache: BufferCache, rows: int, bucketed: bool = False
    ) -> torch.Tensor:
        step = DecodeStep.of(self.model)
        assert step is not None, "decode needs a model DecodeStep describes (see DecodeStep.serves)"
        self._count("fallback")  # eager: not the static path CUDA would replay
        return step(tokens, position, cache, rows, bucketed)

    @cached_property
    def rows_agree(self) -> bool:
        """Whether a row of a several-row step gets the bits it gets in a one-row step, so a speculative step
        without drafts can run one row and speculation still equals plain decoding bit for bit: every linear
        layer is weight-only quantized with its CPU kernel (``weights.KERNEL_ROWS``; measured on AVX-512 and AVX2).
        Not for dense float32 or bfloat16, whose GEMMs pick kernels by row count (MKL, oneDNN)."""
        linears = [m for m in self.model.modules() if isinstance(m, nn.Linear | QuantizedLinear)]
        return (
            self.device.type == "cpu"
            and bool(linears)
            and all(isinstance(m, QuantizedLinear) and m.kernel_tensors() is not None for m in linears)
        )

    @property
    def speculates(self) -> bool:
        """Whether ``verify`` runs (the CPU's eager step; a speculative step computes ``STEP_ROWS`` rows). Not
        under CUDA graphs (nor their CPU bookkeeping mode) yet, whose decode bucket is one token."""
        return not self.static and self._static is not None

    @property
    def speculates_by_default(self) -> bool:
        """Whether a request that leaves ``speculative`` unset speculates: where it measured faster, models whose
        every linear layer runs a quantized CPU kernel (``rows_agree``: a step without drafts costs one row; int4
        decode tokens/s with speculation over without, ``examples/results/answer_time_int4.json``)."""
        return self.speculates and self.rows_agree

    def serves(self, cache: object, call: ModelCall = PLAIN) -> bool:
        """Whether ``decode`` can step ``cache`` under ``call``: a batch-one buffer cache of a model the fused step
        describes, and a call that adds no attention kwargs. A call's context (an adapter applied) is honoured:
        the step adds a merged adapter's term to the fused kernels' rows and runs a layer a hook acts on as its module
        (``decode_step.kernel_corrections``); CUDA graphs, captured
        once, take plain calls only."""
        if not (isinstance(cache, BufferCache) and DecodeStep.serves(cache) and self._static is not None):
            return False
        if call.is_plain:
            return True
        step = DecodeStep.of(self.model)
        return not call.kwargs and not self.static and step is not None

    @torch.inference_mode()
    def prepare(self, buffer: KVBuffer, length: int = 0) -> None:
        """Capture every bucket that fits ``buffer`` (``length`` tokens cached), once per buffer: call it when a
        buffer is acquired, before any timer, so that no capture lands in a timed call."""
        if self.static:
            self._bucket(buffer, 1, length)

    def _count(self, kind: str) -> None:
        with self._lock:
            self.calls[kind] += 1

    def _bucket(self, buffer: KVBuffer, bucket: int, length: int) -> BucketForward:
        """The forward of ``bucket`` over ``buffer``. A buffer seen for the first time (``length`` tokens cached) has
        the slots after them zeroed, then every bucket that fits after them captured (written only at
        ``capture_length``)."""
        assert self._static is not None
        keys, values = buffer.keys, buffer.values
        capacity = keys.shape[-2]
        with self._lock:
            if self._key(keys, values, 1) not in self._captured:
                # a masked slot still enters P @ V with weight 0, so it must hold no NaN (fresh memory may)
                keys[..., length:, :].zero_()
                values[..., length:, :].zero_()
                for size in (1, *PREFILL_BUCKETS):
                    if length + size <= capacity:  # a bucket that fits no longer request is captured on first use
                        self._capture(keys, values, size)
            key = self._key(keys, values, bucket)
            if key not in self._captured:  # evicted since: capture it alone
                self._capture(keys, values, bucket)
            self._captured.move_to_end(key)
            return self._captured[key]

    @staticmethod
    def _key(keys: torch.Tensor, values: torch.Tensor, bucket: int) -> tuple[int, int, int, int]:
        return (keys.data_ptr(), values.data_ptr(), keys.shape[-2], bucket)

    def _capture(self, keys: torch.Tensor, values: torch.Tensor, bucket: int) -> None:
        assert self._static is not None
        if self.graphs:
            made: BucketForward = GraphedForward(self._static, keys, values, bucket, self._pool)
        else:
            made = BucketForward(self._static, keys, values, bucket)
        self.calls["captures"] += 1
        self._captured[self._key(keys, values, bucket)] = made
        while len(self._captured) > MAX_GRAPHS:
            self._captured.popitem(last=False)
