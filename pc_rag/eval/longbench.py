"""LongBench's multi-doc QA conventions: the prompt's text pieces and the ``qa_f1_score`` metric.

Scoring follows LongBench's ``metrics.py`` exactly (lowercase, drop punctuation, drop the articles
a/an/the, collapse whitespace, token-level F1; the max over gold answers; the mean times 100).
This module knows nothing about chat templates or models: the engine's ``RagPrompt.longbench()``
wraps these pieces in the model's template.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence

INSTRUCTION = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
)
CONTEXT_HEADER = "The following are given passages."

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def passage_text(i: int, title: str, text: str) -> str:
    """The context piece of passage ``i`` (1-based), as LongBench joins them."""
    return f"Passage {i}:\n{title}\n{text}\n\n"


def context_text(passages: Iterable[tuple[str, str]]) -> str:
    """LongBench's ``{context}``: every (title, text) rendered by ``passage_text`` in order."""
    return "".join(passage_text(i, title, text) for i, (title, text) in enumerate(passages, start=1))


def normalize_answer(s: str) -> str:
    """Lowercase, remove punctuation, remove the articles a/an/the, collapse whitespace (LongBench order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """F1 of the multiset overlap of two token lists; 0 when nothing is shared."""
    num_same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str) -> float:
    """LongBench's ``qa_f1_score``: token F1 of the normalized prediction against one gold answer, in [0, 1]."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def best_f1(prediction: str, answers: Iterable[str]) -> float:
    """The max ``qa_f1_score`` over the gold ``answers`` (0 if there are none), as LongBench's scorer."""
    return max((qa_f1_score(prediction, a) for a in answers), default=0.0)
