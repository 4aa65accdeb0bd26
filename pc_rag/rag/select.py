"""Choose which chunk tokens to recompute: each chunk's first tokens, and the most deviating ones.

Deviation follows CacheBlend: run the first ``probe_layer + 1`` layers over the
assembled prompt with full attention and compare each chunk token's fresh
key/value at ``probe_layer`` with the spliced one; the tokens whose KV moved
most are the ones cross-chunk attention matters for. This module knows nothing
about prompts or generation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from pc_rag.kv import KVBuffer, PreallocatedLayer


def edge_indices(spans: Sequence[tuple[int, int]], edge: int) -> list[int]:
    """The first ``edge`` cache indices of each ``(start, length)`` span."""
    return [i for start, length in spans for i in range(start, start + min(edge, length))]


@torch.inference_mode()
def kv_deviation(
    model: PreTrainedModel,
    buffer: KVBuffer,
    head: int,
    ids: Sequence[int],
    positions: Sequence[int],
    probe_layer: int,
) -> torch.Tensor:
    """Per-token L2 deviation [N] at ``probe_layer`` between fresh and spliced KV of cache entries ``head..head+N``.

    The fresh KV comes from the first ``probe_layer + 1`` layers run over the
    ``N`` tokens after the (exact) head, with causal attention.
    """
    decoder = model.get_decoder()
    layers = decoder.layers
    n = len(ids)
    probe = [
        PreallocatedLayer(
            torch.empty_like(buffer.keys[i][:, :, : head + n]), torch.empty_like(buffer.values[i][:, :, : head + n]), 0
        )
        for i in range(probe_layer + 1)
    ]
    for i, layer in enumerate(probe):
        layer.update(buffer.keys[i][:, :, :head], buffer.values[i][:, :, :head])
    device = buffer.keys.device
    decoder.layers = nn.ModuleList(layers[: probe_layer + 1])  # run only the probe's prefix of the network
    try:
        decoder(
            input_ids=torch.tensor([list(ids)], device=device),
            position_ids=torch.tensor([list(positions)], device=device),
            past_key_values=Cache(layers=probe),
            use_cache=True,
        )
    finally:
        decoder.layers = layers
    fresh_k, fresh_v = probe[probe_layer].keys[:, :, head:], probe[probe_layer].values[:, :, head:]
    old_k = buffer.keys[probe_layer][:, :, head : head + n]
    old_v = buffer.values[probe_layer][:, :, head : head + n]
    # [B, H, N, D] -> [N]: deviation summed over heads and batch
    return ((fresh_k - old_k).square().sum((-1, 1, 0)) + (fresh_v - old_v).square().sum((-1, 1, 0))).sqrt()


def top_indices(deviation: torch.Tensor, count: int, offset: int, exclude: set[int]) -> list[int]:
    """Cache indices (``offset`` + token index) of the ``count`` largest deviations not in ``exclude``."""
    if count <= 0:
        return []
    order = torch.argsort(deviation, descending=True).tolist()
    return [offset + i for i in order if offset + i not in exclude][:count]
