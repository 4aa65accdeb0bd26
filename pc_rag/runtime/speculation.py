"""Speculative decoding from the request's own tokens: drafts looked up in the prompt, verified in one step.

A RAG answer copies from its passages, and the runtime holds every spliced chunk's token ids, so drafts are
free: ``PromptLookup`` proposes the tokens that followed the latest earlier occurrence of the output's last
n-gram in the prompt and the answer so far (prompt lookup decoding, as transformers' ``prompt_lookup_num_tokens``
and llama.cpp's lookup decoding). One ``DecodeStep`` verifies the fed token and its drafts, and ``accept`` keeps
the drafts the model would have produced:

- greedy: a draft is kept while it equals the argmax of the row before it, so the output is the plain output;
- sampled: the rule of speculative sampling for a point-mass draft (Leviathan et al. 2023; Chen et al. 2023):
  keep draft ``d`` with probability ``p(d)``, else sample from ``p`` with ``d`` removed and stop. Each emitted
  token is then distributed as plain sampling's.

Where the request's own tokens hold no match, or a weak one, the model's stock phrases can draft instead
(``answer_phrases``: what its answers to training questions said after the same words).

This module knows nothing about models or caches: it receives token ids, logits and sampling settings.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from pc_rag.runtime.answer_phrases import AnswerPhrases

MAX_NGRAM = 3
"""Longest suffix of the output matched in the context; shorter ones are tried when it has no earlier match."""


class PromptLookup:
    """Drafts for the next tokens: what followed the latest earlier occurrence of the text's last n tokens
    (n = ``max_ngram`` down to 1). ``append`` adds each emitted token to the text searched.

    With ``phrases``, the answer's stock phrases draft instead where the phrase table matched more of the answer's
    last tokens than the text did (none counts 0): the longer match wins (``docs/decoding.md``)."""

    def __init__(
        self, context: Sequence[int], max_ngram: int = MAX_NGRAM, room: int = 256, phrases: AnswerPhrases | None = None
    ) -> None:
        self._ids = np.zeros(len(context) + room, dtype=np.int64)
        self._ids[: len(context)] = context
        self._length = self._start = len(context)
        self._max_ngram = max_ngram
        self._phrases = phrases
        self.matched = 0
        """The length of the suffix the last ``propose`` matched (0: none)."""
        self.agreed = False
        """Whether every earlier occurrence of that suffix was followed by the token the last ``propose`` drafted
        first: one continuation in the text (or in the fitted answers), not the most recent (or frequent) of
        several."""
        self.source = "context"
        """Where the last ``propose`` drafted from: ``context`` (the request's tokens) or ``phrases``."""

    def append(self, token: int) -> None:
        if self._length == len(self._ids):
            self._ids = np.concatenate([self._ids, np.zeros_like(self._ids)])
        self._ids[self._length] = token
        self._length += 1

    def propose(self, count: int) -> list[int]:
        """Up to ``count`` draft tokens (none when no suffix of the text occurred before and no phrase matched)."""
        self.source = "context"
        drafts = self._from_text(count)
        if self._phrases is None or count <= 0:
            return drafts
        tail = self._ids[max(self._start, self._length - self._phrases.max_context) : self._length].tolist()
        phrased, matched, agreed = self._phrases.draft(tail, count)  # the answer's last tokens (all, if fewer)
        if phrased and matched > self.matched:
            self.matched, self.agreed, self.source = matched, agreed, "phrases"
            return phrased
        return drafts

    def _from_text(self, count: int) -> list[int]:
        ids, end = self._ids, self._length
        self.matched, self.agreed = 0, False
        if count <= 0:
            return []
        for n in range(min(self._max_ngram, end - 1), 0, -1):
            # starts i < end - n where ids[i : i + n] equals the last n tokens
            found = ids[: end - n] == ids[end - n]
            for j in range(1, n):
                found &= ids[j : end - n + j] == ids[end - n + j]
            starts = np.flatnonzero(found)
            if len(starts):
                after = int(starts[-1]) + n
                self.matched = n
                self.agreed = bool((ids[starts + n] == ids[after]).all())
                return ids[after : min(after + count, end)].tolist()
        return []


def accept(
    logits: torch.Tensor,
    drafts: Sequence[int],
    greedy: bool,
    probabilities: Callable[[torch.Tensor], torch.Tensor],
    generator: torch.Generator | None,
) -> list[int]:
    """Tokens emitted from a verify step's ``logits`` [1 + len(drafts), V], where row t predicts the token after
    the fed token and ``drafts[:t]``: the kept drafts, then one token of the model's own (emitted token t is picked
    from row t). ``probabilities(row)`` is one row's sampling distribution [V] (temperature, top-k, top-p);
    ``greedy`` takes the argmax instead."""
    if greedy:
        picks = logits.argmax(-1).tolist()
        out: list[int] = []
        for pick, draft in zip(picks, drafts, strict=False):
            out.append(pick)
            if pick != draft:
                return out
        return [*out, picks[len(drafts)]]
    out = []
    for t, draft in enumerate(drafts):
        p = probabilities(logits[t]).cpu()
        if torch.rand((), generator=generator) < p[draft]:
            out.append(draft)
            continue
        p[draft] = 0  # the residual max(p - q, 0) of a point-mass draft q; multinomial renormalizes it
        out.append(int(torch.multinomial(p, 1, generator=generator)))
        return out
    p = probabilities(logits[len(drafts)]).cpu()
    return [*out, int(torch.multinomial(p, 1, generator=generator))]
