"""Recompute chosen cached tokens with full attention, in the same forward as the question.

After splicing, the cache holds ``T`` tokens; a few of them (edge tokens,
high-deviation tokens) are stale: they were encoded without the chunks before
them. One forward runs ``[selected..., question...]``: a selected token at cache
index ``c`` attends to the non-selected cache before ``c`` and to the fresh
selected tokens up to itself; question tokens attend to every non-selected
cached token, every fresh selected token and the question causally. The fresh
KV then overwrites the stale entries, and the question's KV is moved down to
follow the cache, so decoding sees one consistent cache. This module knows
nothing about chunks, modes or retrieval: it works on cache indices.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from pc_rag.kv import KVBuffer


def recompute_mask(cached: int, selected: Sequence[int], new: int, window: int | None = None) -> torch.Tensor:
    """Bool mask [1, 1, S+N, T+S+N] for ``selected`` (sorted cache indices) followed by ``new`` tokens.

    With ``window`` (sliding-window layers) a key farther than ``window`` indices
    from its query, measured at the indices the tokens end up in, is also hidden.
    """
    sel = torch.as_tensor(list(selected), dtype=torch.long)
    n_sel = sel.numel()
    q_len, k_len = n_sel + new, cached + n_sel + new
    mask = torch.zeros(q_len, k_len, dtype=torch.bool)
    stale = torch.zeros(cached, dtype=torch.bool)
    stale[sel] = True
    cache_idx = torch.arange(cached)
    mask[:n_sel, :cached] = (cache_idx[None, :] < sel[:, None]) & ~stale[None, :]
    mask[n_sel:, :cached] = ~stale[None, :]
    mask[:, cached:] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
    if window is not None:
        final = torch.cat((sel, torch.arange(cached, cached + new)))  # where each query's KV ends up
        key_final = torch.cat((cache_idx, final))
        mask &= (final[:, None] - key_final[None, :]) < window
    return mask[None, None]


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
) -> tuple[torch.Tensor, object]:
    """Refresh ``selected`` cache entries and run ``new_ids``; return last logits [V] and the cache (length T+N)."""
    device = buffer.keys.device
    n_sel, n_new = len(selected), len(new_ids)
    config = model.config.get_text_config()
    full = recompute_mask(cached, selected, n_new).to(device)
    layer_types = getattr(config, "layer_types", None) or []
    mask: object = full
    if "sliding_attention" in layer_types:
        sliding = recompute_mask(cached, selected, n_new, window=config.sliding_window).to(device)
        mask = {"full_attention": full, "sliding_attention": sliding}
    cache = buffer.cache(cached)
    out = model(
        input_ids=torch.tensor([[*selected_ids, *new_ids]], device=device),
        position_ids=torch.tensor([[*selected_positions, *new_positions]], device=device),
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    if n_sel:
        index = torch.as_tensor(list(selected), device=device)
        for tensor in (buffer.keys, buffer.values):  # [L, 1, H, cap, D]
            tensor[:, :, :, index] = tensor[:, :, :, cached : cached + n_sel]
            tensor[:, :, :, cached : cached + n_new] = tensor[:, :, :, cached + n_sel : cached + n_sel + n_new].clone()
        for layer in cache.layers:
            layer.crop(-n_sel)
    return out.logits[0, -1], cache
