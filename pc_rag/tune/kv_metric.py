"""What an error in stored KV costs the model, per (keys|values, layer, KV head): the metric CacheGen's transform
is fitted in (``pc_rag.codec.fit_tables``).

Keys meet the model only through ``q . k``: an error ``e`` in a key costs ``sum over queries of (q . e)^2``, so
the keys' metric is the second moment of the queries that read them (after RoPE, over the query heads sharing
the KV head), measured in full prefills of real prompts. Values leave attention through ``o_proj``: an error
``e`` costs ``|W_h e|^2`` for each query head ``h`` sharing the value, so their metric is the sum of
``W_h^T W_h``. Both are normalised to a mean eigenvalue of one per head (only their shape matters).

Only the keys' metric is used by default: on the tuning split (examples/results/codec_metric.json) weighting the
values by ``o_proj`` as well raised the default mode's first-token KL at step 0.6 (0.0097 to 0.0108 by the
metric's floor, against 0.0059, all at about 3.2 KB/token); the default mode's deviation probe reads values as
they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from pc_rag.model import LoadedModel
from pc_rag.probe import QUERIES_KWARG


def kv_metric(lm: LoadedModel, prompts: Iterable[Sequence[int]], *, weigh_values: bool = False) -> torch.Tensor:
    """The metric [2, L, H_kv, D, D] of ``lm``'s keys (queries of full prefills of ``prompts``) and values
    (``o_proj`` if ``weigh_values``, else the identity: every error costs its squared size)."""
    keys = _normalised(query_moments(lm, prompts))
    values = _normalised(output_moments(lm)) if weigh_values else torch.eye(keys.shape[-1]).expand_as(keys)
    return torch.stack([keys, values])


def query_moments(lm: LoadedModel, prompts: Iterable[Sequence[int]]) -> torch.Tensor:
    """Per layer and KV head, the sum of ``q^T q`` [L, H_kv, D, D] over the queries (after RoPE) of the heads
    that share it, in full prefills of ``prompts`` (token ids; the decoder only, no logits)."""
    moments = _QueryMoments()
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([list(ids)], device=lm.device)
            lm.model.get_decoder()(input_ids=input_ids, use_cache=False, **{QUERIES_KWARG: moments})
    if not moments.sums:
        raise ValueError("measuring the queries' moments needs at least one prompt")
    return torch.stack([moments.sums[i] for i in sorted(moments.sums)]).cpu()


def output_moments(lm: LoadedModel) -> torch.Tensor:
    """Per layer and KV head, ``sum_h W_h^T W_h`` [L, H_kv, D, D] over the query heads ``h`` sharing it, ``W_h``
    the columns of ``o_proj`` that head's output meets (read through the layer, so quantized weights work too)."""
    config = lm.model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    out = []
    eye = torch.eye(heads * dim, device=lm.device, dtype=lm.dtype)
    with torch.inference_mode():
        for layer in lm.model.model.layers:
            o_proj = layer.self_attn.o_proj
            columns = (o_proj(eye) - o_proj(torch.zeros_like(eye[:1]))).double().cpu()  # row j: o_proj of e_j
            per_head = columns.view(kv_heads, heads // kv_heads, dim, -1)
            out.append(torch.einsum("grdo,greo->gde", per_head, per_head))
    return torch.stack(out)


def _normalised(moments: torch.Tensor) -> torch.Tensor:
    """``moments`` [..., D, D] scaled to a mean eigenvalue (trace / D) of one each."""
    trace = moments.diagonal(dim1=-2, dim2=-1).sum(-1)
    return (moments * (moments.shape[-1] / trace)[..., None, None]).float()


class _QueryMoments:
    """Sums ``q^T q`` per layer and KV head; travels as the attention kwarg ``QUERIES_KWARG``."""

    def __init__(self) -> None:
        self.sums: dict[int, torch.Tensor] = {}

    def capture(self, layer: int, query: torch.Tensor, key: torch.Tensor) -> None:
        batch, heads, length, dim = query.shape  # head h = g * n_rep + r shares KV head g
        grouped = query.detach().double().reshape(batch, key.shape[1], heads // key.shape[1] * length, dim)
        self.sums[layer] = self.sums.get(layer, 0) + torch.einsum("bhqd,bhqe->hde", grouped, grouped)
