"""Query-aware choice of chunk tokens to recompute (ProphetKV, A^3): the tokens the question attends to.

The question is run over the stale spliced cache through the first ``layers`` decoder
layers only; each probed layer's attention function adds, for every cache entry, the
attention probability it receives from the question's rows (summed over heads and rows)
to an ``AttentionProbe`` passed as the attention kwarg ``pc_rag_probe``; after the last
probed layer the forward is stopped. Chosen tokens are the highest-scoring chunk tokens,
widened to small windows around them, plus each chunk's first tokens. Nothing of the
shared model is changed. This module knows nothing about prompts or generation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from pc_rag.kv import KVBuffer, PreallocatedLayer
from pc_rag.probe import KWARG as PROBE
from pc_rag.probe import AttentionProbe, ProbeDone
from pc_rag.runtime.model_call import PLAIN, ModelCall, with_cache


@torch.inference_mode()
def question_attention(
    model: PreTrainedModel,
    buffer: KVBuffer,
    cached: int,
    ids: Sequence[int],
    positions: Sequence[int],
    layers: int,
    call: ModelCall = PLAIN,
) -> torch.Tensor:
    """Attention mass [cached] that ``ids`` (the question) put on each cache entry in the first ``layers`` layers.

    The question runs through ``call`` as it will in the real forward (adapter, calibration); its own
    KV is written past ``cached`` in the buffer and is overwritten by the real forward.
    """
    probe = AttentionProbe(cached, layers)
    device = buffer.keys.device
    cache = Cache(
        layers=[PreallocatedLayer(buffer.keys[i], buffer.values[i], cached) for i in range(buffer.keys.shape[0])]
    )
    with contextlib.suppress(ProbeDone):  # raised by the probe after its last layer
        call(
            model.get_decoder(),
            input_ids=torch.tensor([list(ids)], device=device),
            position_ids=torch.tensor([list(positions)], device=device),
            **with_cache(cache),
            use_cache=True,
            **{PROBE: probe},
        )
    assert probe.scores is not None, "the probe saw no attention layer"
    return probe.scores


def query_indices(
    scores: torch.Tensor,
    spans: Sequence[tuple[int, int]],
    share: float,
    window: int = 0,
    edge: int = 0,
) -> list[int]:
    """Sorted cache indices to recompute: each span's first ``edge`` tokens, then the top-scoring chunk tokens.

    ``spans`` are the chunks' ``(start, length)``; ``share`` of all chunk tokens is chosen (windows of
    ``window`` tokens on each side of a chosen token count towards the budget).
    """
    chunk_index = torch.cat([torch.arange(s, s + n) for s, n in spans]) if spans else torch.empty(0, dtype=torch.long)
    budget = round(share * chunk_index.numel())
    chosen = {i for s, n in spans for i in range(s, s + min(edge, n))}
    budget += len(chosen)
    inside = torch.zeros(scores.shape[0], dtype=torch.bool)
    inside[chunk_index] = True
    order = torch.argsort(scores.cpu().masked_fill(~inside, float("-inf")), descending=True).tolist()
    for i in order:
        if len(chosen) >= budget or not inside[i]:
            break
        for j in range(i - window, i + window + 1):
            if 0 <= j < inside.numel() and inside[j] and len(chosen) < budget:
                chosen.add(j)
    return sorted(chosen)
