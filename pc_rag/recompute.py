"""Recompute chosen cached tokens with full attention, in the same forward as the question.

After splicing, the cache holds ``T`` tokens; a few of them (edge tokens,
high-deviation tokens) are stale: they were encoded without the chunks before
them. One forward runs ``[selected..., question...]``. In every layer the fresh
KV of the selected tokens overwrites their stale entries in place before
attention, so a selected token at cache index ``c`` attends to the cache up to
``c`` (fresh where recomputed, stale elsewhere) and the question attends to the
whole refreshed cache, then causally to itself. The question's KV follows the
cache, so decoding continues from one consistent cache of ``T + N`` entries.
The attention gets this structure as ``QueryBlocks`` (each query's cache index),
never as a dense [S+N, T+N] mask. This module knows nothing about chunks, modes
or retrieval: it works on cache indices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from pc_rag.attention import QueryBlocks
from pc_rag.kv import KVBuffer, PreallocatedLayer
from pc_rag.runtime.model_call import PLAIN, ModelCall, with_cache


class RefreshLayer(PreallocatedLayer):
    """A cache layer whose first ``len(index)`` new entries overwrite cache entries ``index``; the rest append."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int, index: torch.Tensor) -> None:
        super().__init__(keys, values, length)
        self._index = index

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n_sel = self._index.numel()  # key_states: [B, H_kv, n_sel + N, D]
        if n_sel:
            self._kbuf[:, :, self._index] = key_states[:, :, :n_sel]
            self._vbuf[:, :, self._index] = value_states[:, :, :n_sel]
        return super().update(key_states[:, :, n_sel:], value_states[:, :, n_sel:])


def recompute_mask(cached: int, selected: Sequence[int], new: int, window: int | None = None) -> torch.Tensor:
    """Bool mask [1, 1, S+N, T+N] for ``selected`` (sorted cache indices, refreshed in place) then ``new`` tokens.

    With ``window`` (sliding-window layers) a key ``window`` or more indices before its query is also hidden.
    This is the semantics ``recompute_and_prefill`` implements; serving never builds it.
    """
    query_index = _query_index(cached, selected, new)  # [S+N]: where each query's KV lives
    key_index = torch.arange(cached + new)  # [T+N]
    mask = key_index[None, :] <= query_index[:, None]
    if window is not None:
        mask &= (query_index[:, None] - key_index[None, :]) < window
    return mask[None, None]


def _query_index(cached: int, selected: Sequence[int], new: int) -> torch.Tensor:
    return torch.cat((torch.as_tensor(list(selected), dtype=torch.long), torch.arange(cached, cached + new)))


@torch.inference_mode()
def recompute_and_prefill(
    model: PreTrainedModel,
    buffer: KVBuffer,
    cached: int,
    selected: Sequence[int],
    selected_ids: Sequence[int],
    selected_positions: Sequence[int],
    new_ids: Sequence[int],
    new_positions: Sequence[int],
    call: ModelCall = PLAIN,
) -> tuple[torch.Tensor, Cache]:
    """Refresh ``selected`` cache entries and run ``new_ids``; return last logits [V] and the cache (length T+N)."""
    device = buffer.keys.device
    n_new = len(new_ids)
    blocks = QueryBlocks.of(_query_index(cached, selected, n_new).to(device))  # once, for every layer
    layer_types = getattr(model.config.get_text_config(), "layer_types", None) or []
    # no mask to build: query_blocks replaces it (and each layer's own sliding window applies)
    mask = {"full_attention": None, "sliding_attention": None} if "sliding_attention" in layer_types else None
    index = torch.as_tensor(list(selected), dtype=torch.long, device=device)
    cache = Cache(
        layers=[RefreshLayer(buffer.keys[i], buffer.values[i], cached, index) for i in range(len(buffer.keys))]
    )
    out = call(
        model,
        input_ids=torch.tensor([[*selected_ids, *new_ids]], device=device),
        position_ids=torch.tensor([[*selected_positions, *new_positions]], device=device),
        attention_mask=mask,
        **with_cache(cache),
        use_cache=True,
        logits_to_keep=1,
        query_blocks=blocks,
    )
    return out.logits[0, -1], buffer.cache(cached + n_new)
