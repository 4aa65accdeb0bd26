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
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from pc_rag.assemble import forward_new_tokens
from pc_rag.decode_step import DecodeStep, FusedLayer, built_once, rms_norm
from pc_rag.kv import BufferCache, KVBuffer
from pc_rag.model_call import PLAIN, ModelCall
from pc_rag.weights import KERNEL_ROWS

logger = logging.getLogger(__name__)

PREFILL_BUCKETS = (16, 32, 64, 128, 256, 512)
"""Padded new-token counts a graph is captured for; longer forwards are compute-bound and run eagerly."""
MAX_GRAPHS = 32
"""Captured graphs kept per model (least recently used dropped): each pins its buffer and a little memory."""


def bucket_for(count: int, buckets: Sequence[int] = PREFILL_BUCKETS) -> int | None:
    """The smallest bucket holding ``count`` new tokens (1 is its own bucket: the decode step); None if none."""
    if count == 1:
        return 1
    return next((b for b in buckets if b >= count), None)


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
        out = out.view(1, kv_heads * n_rep, count, head_dim).transpose(1, 2).reshape(1, count, -1)
        return fused.finish(x, out, small)


class GraphedForward:
    """A ``StaticForward`` of one bucket over one buffer, captured as a CUDA graph; ``run`` replays it.

    Inputs are copied into the graph's own device tensors; the logits are a tensor the graph overwrites
    (copy them before the next replay if they must outlive it)."""

    def __init__(self, forward: StaticForward, buffer: KVBuffer, bucket: int, pool: Any) -> None:
        device = buffer.keys.device
        self.buffer, self.bucket = buffer, bucket
        # every input in one device tensor, so a replay's inputs arrive in one copy: tokens, positions, length, last
        self.inputs = torch.zeros(2 * bucket + 2, dtype=torch.long, device=device)
        self.tokens, self.positions = self.inputs[:bucket].view(1, bucket), self.inputs[bucket:-2].view(1, bucket)
        self.length, self.last = self.inputs[-2:-1], self.inputs[-1:]
        args = (self.tokens, self.positions, self.length, self.last, buffer.keys, buffer.values)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up outside the graph: lazy inits and autotuning happen here
            forward(*args)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = forward(*args)

    def run(self, ids: Sequence[int], positions: Sequence[int], length: int) -> torch.Tensor:
        count = len(ids)
        padded_ids = [*ids, *([0] * (self.bucket - count))]
        padded_positions = [*positions, *([positions[-1]] * (self.bucket - count))]
        staged = torch.tensor([*padded_ids, *padded_positions, length, count - 1]).pin_memory()
        self.inputs.copy_(staged, non_blocking=True)
        self.graph.replay()
        return self.logits


class ModelRunner:
    """The forwards of one model: ``forward`` (new tokens after a spliced cache) and ``decode`` (one token).

    ``graphs``: capture and replay CUDA graphs (default: on when the model is on CUDA and ``StaticForward``
    describes it). Graphs are keyed by buffer and bucket and kept in an LRU of ``MAX_GRAPHS``.
    """

    def __init__(self, model: PreTrainedModel, graphs: bool | None = None) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self._static = StaticForward.of(model)
        self.graphs = (self.device.type == "cuda" and self._static is not None) if graphs is None else graphs
        if self.graphs and (self.device.type != "cuda" or self._static is None):
            msg = f"CUDA graphs need a CUDA model that StaticForward describes (device {self.device})"
            raise ValueError(msg)
        self._captured: OrderedDict[tuple[int, int, int], GraphedForward] = OrderedDict()
        self._pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self._lock = threading.Lock()

    @classmethod
    def of(cls, model: PreTrainedModel) -> ModelRunner:
        """The model's runner, built once per model (for every model: one ``StaticForward`` does not describe
        runs eagerly)."""
        runner = built_once(cls, model, described_only=False)
        assert runner is not None
        return runner

    @torch.inference_mode()
    def forward(
        self, buffer: KVBuffer, length: int, ids: Sequence[int], positions: Sequence[int]
    ) -> tuple[torch.Tensor, BufferCache]:
        """Run ``ids`` at ``positions`` after ``length`` cached tokens of ``buffer``; last logits [V] and the cache."""
        bucket = bucket_for(len(ids)) if self.graphs else None
        if bucket is None or length + bucket > buffer.keys.shape[-2]:
            return forward_new_tokens(self.model, buffer, length, ids, positions)
        logits = self._graph(buffer, bucket, length).run(ids, positions, length)
        cache = buffer.cache(length + len(ids))
        return logits.clone(), cache

    @torch.inference_mode()
    def decode(self, token: int, position: int, cache: BufferCache) -> torch.Tensor:
        """The logits [V] after ``token`` at ``position``, written after the cache's tokens (the cache advances)."""
        if not self.graphs:
            return self.verify([token], position, cache)[0]
        length = cache.get_seq_length()
        buffer = cache.gathered(room=1)
        logits = self._graph(buffer, 1, length).run([token], [position], length)
        for layer in cache.layers:
            layer.advance(1)
        return logits.clone()

    @torch.inference_mode()
    def verify(self, tokens: Sequence[int], position: int, cache: BufferCache) -> torch.Tensor:
        """The logits [T, V] after each of ``tokens`` (a fed token, then drafts; T <= ``STEP_ROWS``) from
        ``position``, all written after the cache's tokens (the cache advances by T; the caller crops rejected
        drafts). Row t equals ``decode`` of ``tokens[t]`` after ``tokens[:t]``, bit for bit (``DecodeStep``)."""
        assert self.speculates, "verify runs the CPU's DecodeStep (CUDA graphs decode one token)"
        step = DecodeStep.of(self.model)
        assert step is not None, "decode needs a model DecodeStep describes (see DecodeStep.serves)"
        return step(tokens, position, cache)

    @property
    def speculates(self) -> bool:
        """Whether ``verify`` runs: drafts cost nothing here (every step computes ``STEP_ROWS`` rows). Not under CUDA
        graphs yet, whose decode bucket is one token."""
        return not self.graphs and self._static is not None

    def serves(self, cache: object, call: ModelCall = PLAIN) -> bool:
        """Whether ``decode`` can step ``cache`` under ``call``: a batch-one buffer cache of a model the fused step
        describes, and a call that adds no attention kwargs. A call's context (an adapter applied) is honoured
        where every linear layer runs as its module; CUDA graphs, captured once, take plain calls only."""
        if not (isinstance(cache, BufferCache) and DecodeStep.serves(cache) and self._static is not None):
            return False
        if call.is_plain:
            return True
        step = DecodeStep.of(self.model)
        return not call.kwargs and not self.graphs and step is not None and step.reads_modules()

    def _graph(self, buffer: KVBuffer, bucket: int, length: int) -> GraphedForward:
        """The graph of ``bucket`` over ``buffer`` (captured on first use, when ``length`` tokens are cached)."""
        assert self._static is not None
        key = (buffer.keys.data_ptr(), buffer.keys.shape[-2], bucket)
        with self._lock:
            graph = self._captured.get(key)
            if graph is None:
                # a masked slot still enters P @ V with weight 0, so it must hold no NaN (fresh memory may)
                buffer.keys[..., length:, :].zero_()
                buffer.values[..., length:, :].zero_()
                graph = GraphedForward(self._static, buffer, bucket, self._pool)
                self._captured[key] = graph
                if len(self._captured) > MAX_GRAPHS:
                    self._captured.popitem(last=False)
            self._captured.move_to_end(key)
            return graph
