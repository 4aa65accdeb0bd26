"""The chunk side of joint training: chunks encoded now by the adapter's encoding side, with gradients.

A store serves chunk KV made once, without gradients. To train an adapter's encoding side, the student
encodes its chunks in the training step instead, exactly as ``RagEngine.encode_token_ids`` does (each chunk
alone, after the preamble if conditioned, at the canonical start) but differentiably, re-rotates each
chunk's keys to its slot and returns the spliced cache: the preamble (plain, as served) then the chunks.
The KL of the question's answer then reaches the encoding side's weights through the chunk keys and values.
This module knows nothing about teachers or losses.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache

from pc_rag.errors import PCRagError
from pc_rag.rag.adapter import SpliceAdapter
from pc_rag.rag.engine import Chunk, RagEngine
from pc_rag.runtime.model_call import with_cache

BATCH = 4  # chunks encoded together, by length


def encoded_chunk_cache(
    engine: RagEngine, adapter: SpliceAdapter, chunks: Sequence[Chunk], slots: Sequence[tuple[int, int]]
) -> DynamicCache:
    """The cache [preamble, chunks at ``slots``] with the chunks encoded now by ``adapter``'s encoding side."""
    if not chunks or len({c.conditioned for c in chunks}) != 1:
        msg = "joint training needs chunks, all encoded the same way (all after the preamble, or all alone)"
        raise PCRagError(msg)
    model, rope, head = engine.lm.model, engine.lm.rope, engine.head_kv
    layers = range(head.keys.shape[0])
    dtype = next(model.parameters()).dtype
    head_k = [head.keys[i].to(engine.lm.device, dtype) for i in layers]  # [H, T, D]
    head_v = [head.values[i].to(engine.lm.device, dtype) for i in layers]
    encoded: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    order = sorted(range(len(chunks)), key=lambda i: len(chunks[i].token_ids))  # similar lengths: little padding
    for b in range(0, len(order), BATCH):
        batch = order[b : b + BATCH]
        kv = _encode(engine, adapter, [chunks[i] for i in batch], head_k, head_v)
        encoded |= dict(zip(batch, kv, strict=True))
    start = engine.canonical_start
    spliced = []
    for i in layers:
        k_parts, v_parts = [head_k[i]], [head_v[i]]
        for row, (slot, _) in enumerate(slots):
            keys, values = encoded[row][i]
            k_parts.append(rope.rotate_differentiable(keys, slot - start, i))
            v_parts.append(values)
        spliced.append((torch.cat(k_parts, dim=1)[None], torch.cat(v_parts, dim=1)[None]))
    return DynamicCache(ddp_cache_data=spliced, config=model.config)


def _encode(
    engine: RagEngine,
    adapter: SpliceAdapter,
    chunks: Sequence[Chunk],
    head_k: Sequence[torch.Tensor],
    head_v: Sequence[torch.Tensor],
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per chunk, per layer, its (keys, values) [H, n, D] at the canonical start, encoded in one padded batch."""
    model, device = engine.lm.model, engine.lm.device
    conditioned = chunks[0].conditioned
    ctx = head_k[0].shape[1] if conditioned else 0
    width, start = max(len(c.token_ids) for c in chunks), engine.canonical_start
    ids = torch.zeros(len(chunks), width, dtype=torch.long)
    for row, chunk in enumerate(chunks):
        ids[row, : len(chunk.token_ids)] = torch.as_tensor(chunk.token_ids)
    positions = torch.arange(start, start + width).expand(len(chunks), width)  # pads continue; causality hides them
    # full layers only (no config): a sliding-window layer would keep just its window of the chunk's KV, while the
    # model still masks each layer as its type says
    if conditioned:
        past = [(k[None].expand(len(chunks), -1, -1, -1), v[None].expand(len(chunks), -1, -1, -1))
                for k, v in zip(head_k, head_v, strict=True)]  # fmt: skip
        cache = DynamicCache(ddp_cache_data=past)
    else:
        cache = DynamicCache()
    with adapter.encoding_applied():
        model.get_decoder()(
            input_ids=ids.to(device), position_ids=positions.to(device), **with_cache(cache), use_cache=True
        )
    return [
        [
            (cache.layers[i].keys[row, :, ctx : ctx + len(c.token_ids)],
             cache.layers[i].values[row, :, ctx : ctx + len(c.token_ids)])
            for i in range(len(head_k))
        ]
        for row, c in enumerate(chunks)
    ]  # fmt: skip
