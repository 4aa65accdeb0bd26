"""The order retrieved chunks are laid out in, between the preamble and the question.

Retrieval ranks chunks best first. A small model leans on the passage next to the question, so
where the best passage sits matters: ``best-first`` keeps the ranking (the weakest chunk ends up
next to the question), ``best-last`` reverses it, and ``lost-in-the-middle`` is LangChain's and
LlamaIndex's ``LongContextReorder`` (Liu et al., 2023): the best chunks at the two ends, the
weakest in the middle. This module knows nothing about chunks, stores or models: it reorders any
list given best first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from pc_rag.errors import PCRagError

T = TypeVar("T")

BEST_FIRST = "best-first"
BEST_LAST = "best-last"
LOST_IN_THE_MIDDLE = "lost-in-the-middle"
ORDERS = (BEST_FIRST, BEST_LAST, LOST_IN_THE_MIDDLE)
# What answering uses unless told otherwise: on open retrieval (top 10 of pooled HotpotQA, 2WikiMQA
# and MuSiQue passages, SmolLM2-135M), best-last had the highest F1 in full prefill, prefix and default.
DEFAULT_ORDER = BEST_LAST


def check_order(order: str) -> str:
    """``order`` if it names an order; ``PCRagError`` listing the known names otherwise."""
    if order not in ORDERS:
        msg = f"unknown chunk order {order!r}; known orders: {', '.join(ORDERS)}"
        raise PCRagError(msg)
    return order


def reorder(ranked: Sequence[T], order: str) -> list[T]:
    """``ranked`` (best first) laid out in ``order``, as a new list.

    ``lost-in-the-middle`` walks the ranking from worst to best, putting items alternately at the
    front and at the back (LangChain's ``_litm_reordering``): ranks 1..5 become 1 3 5 4 2 and ranks
    1..4 become 2 4 3 1, so with an even count the best item is last.
    """
    check_order(order)
    if order == BEST_FIRST:
        return list(ranked)
    if order == BEST_LAST:
        return list(reversed(ranked))
    laid_out: list[T] = []
    for i, item in enumerate(reversed(ranked)):
        if i % 2:
            laid_out.append(item)
        else:
            laid_out.insert(0, item)
    return laid_out
