"""Choose which chunk tokens to recompute: each chunk's first tokens, and the most deviating ones.

Deviation follows CacheBlend: run the network over the assembled prompt with
full attention up to the values of ``probe_layer`` (a ``ValueProbe`` stops the forward
there; no module of the shared model is changed, so concurrent requests are safe)
and compare each chunk token's fresh value with the spliced one; the
tokens whose values moved most are the ones cross-chunk attention matters for.
Values are compared rather than keys because they are cached exactly as
projected (no RoPE, no norm), in every supported architecture. This module
knows nothing about prompts or generation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache

from pc_rag.kv import KVBuffer, PreallocatedLayer
from pc_rag.probe import VALUES_KWARG, ProbeDone, ValueProbe
from pc_rag.runtime.model_call import with_cache


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
    """Per-token L2 deviation [N] at ``probe_layer`` between fresh and spliced values of entries ``head..head+N``.

    The fresh values come from the first ``probe_layer`` layers run over the ``N``
    tokens after the (exact) head with causal attention, then ``probe_layer``'s
    values as its attention receives them; the forward is stopped there.
    """
    n = len(ids)
    probe = [
        PreallocatedLayer(
            torch.empty_like(buffer.keys[i][:, :, : head + n]), torch.empty_like(buffer.values[i][:, :, : head + n]), 0
        )
        for i in range(probe_layer + 1)
    ]
    for i, layer in enumerate(probe):
        layer.update(buffer.keys[i][:, :, :head], buffer.values[i][:, :, :head])
    # layers after the probe never run; they are listed (the head only, never written) for mask sizes
    probe += [
        PreallocatedLayer(buffer.keys[i][:, :, :head], buffer.values[i][:, :, :head], head)
        for i in range(probe_layer + 1, buffer.keys.shape[0])
    ]
    device = buffer.keys.device
    values = ValueProbe(probe_layer, n)
    with contextlib.suppress(ProbeDone):  # raised at the probe layer: what follows is not needed
        model.get_decoder()(
            input_ids=torch.tensor([list(ids)], device=device),
            position_ids=torch.tensor([list(positions)], device=device),
            **with_cache(Cache(layers=probe)),
            use_cache=True,
            **{VALUES_KWARG: values},
        )
    assert values.values is not None, "the probe layer was never reached"
    old_v = buffer.values[probe_layer][:, :, head : head + n]  # [B, H_kv, N, D]
    return (values.values - old_v).square().sum((-1, 1, 0)).sqrt()  # [N]: summed over heads and batch


def deviation_indices(
    model: PreTrainedModel,
    buffer: KVBuffer,
    head: int,
    ids: Sequence[int],
    share: float,
    probe_layer: int,
    exclude: set[int] | frozenset[int] = frozenset(),
) -> list[int]:
    """Cache indices of the ``share`` of chunk tokens (entries ``head...``) whose values deviate most at
    ``probe_layer``, leaving out ``exclude``: what ``selective:<share>`` recomputes."""
    deviation = kv_deviation(model, buffer, head, ids, range(head, head + len(ids)), probe_layer)
    return top_indices(deviation, round(share * len(ids)), head, exclude)


def top_indices(deviation: torch.Tensor, count: int, offset: int, exclude: set[int] | frozenset[int]) -> list[int]:
    """Cache indices (``offset`` + token index) of the ``count`` largest deviations not in ``exclude``."""
    if count <= 0:
        return []
    order = torch.argsort(deviation, descending=True).tolist()
    return [offset + i for i in order if offset + i not in exclude][:count]
