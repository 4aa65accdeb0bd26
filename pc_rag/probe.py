"""The attention probe of query-aware selection: how much attention the question puts on each cache entry.

An ``AttentionProbe`` travels through a model call as the attention kwarg ``pc_rag_probe``;
each attention layer hands it the question's queries and the keys, and it accumulates, per
cache entry, the attention probability received from the question's rows (summed over heads
and rows). After the last probed layer it raises ``ProbeDone`` so the caller can stop the
forward. This module knows nothing about chunks or selection.
"""

from __future__ import annotations

import torch

from pc_rag.calibration import packed_scores, trailing_rows_mask

KWARG = "pc_rag_probe"


class ProbeDone(Exception):
    """Raised once the last probed layer has scored the cache: the rest of the forward is not needed."""


class AttentionProbe:
    """Per-cache-entry attention mass from the question's rows, accumulated over probed layers."""

    def __init__(self, cached: int, layers: int) -> None:
        self.cached, self.layers = cached, layers
        self.scores: torch.Tensor | None = None  # [cached]

    def add(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float, window: int | None = None
    ) -> None:
        """Score the cached keys with ``query`` [B, H, Q, D] (the question, whose keys are the last Q of ``key``
        [B, H_kv, S, D]); stop after the last probed layer."""
        allowed = trailing_rows_mask(query.shape[2], key.shape[2], key.device, window)
        logits, _ = packed_scores(query, key, scaling, allowed)  # [B, H_kv, n_rep*Q, S]
        mass = logits.softmax(-1)[..., : self.cached].sum((0, 1, 2))  # [cached]
        self.scores = mass if self.scores is None else self.scores + mass
        if layer + 1 >= self.layers:
            raise ProbeDone


VALUES_KWARG = "pc_rag_value_probe"
QUERIES_KWARG = "pc_rag_query_probe"  # an object whose ``capture(layer, query, key)`` sees each layer's queries


class ValueProbe:
    """The values the last ``tokens`` cache entries (the call's own tokens) hold at ``layer``; stops the forward
    there. Travels as the attention kwarg ``pc_rag_value_probe``: nothing of the model is changed."""

    def __init__(self, layer: int, tokens: int) -> None:
        self.layer, self.tokens = layer, tokens
        self.values: torch.Tensor | None = None  # [B, H_kv, tokens, D]

    def capture(self, layer: int, value: torch.Tensor) -> None:
        """Called by each attention layer with its keys' values [B, H_kv, S, D] (the cache's, after update)."""
        if layer == self.layer:
            self.values = value[:, :, value.shape[2] - self.tokens :]
            raise ProbeDone
