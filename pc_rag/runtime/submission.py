"""What passes between a caller's thread and the scheduler's worker for one submitted request: the request, the
queue its tokens (or its error, then ``END``) come through, the first logits of a batched request (``Started``),
and the caller's handle on the reply (``Submitted``, which can cancel it). This module knows nothing about
batching or models."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from pc_rag.runtime.generate import DecodedTokens, GenerationResult
from pc_rag.runtime.request import Request

END = object()  # after a request's last token


@dataclass(frozen=True)
class Started:
    """What the caller's thread needs to report a batched request: its first logits and (cached, computed)."""

    logits: torch.Tensor
    counts: tuple[int, int]


class TokenChannel(DecodedTokens):
    """The token ids of one batched request, as the worker decodes them; ``cancelled`` when the caller stops."""

    def __init__(self) -> None:
        super().__init__([])
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.cancelled = threading.Event()

    def __next__(self) -> int:
        item = self.queue.get()
        if item is END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, int)
        return item


class Submitted(Iterator[str | GenerationResult]):
    """A submitted request's reply: text deltas, then its ``GenerationResult``; ``cancel()`` from any thread stops
    it (a waiting request is dropped, a live one leaves the batch at its next step)."""

    def __init__(self, items: Iterator[str | GenerationResult], cancelled: threading.Event) -> None:
        self._items, self._cancelled = items, cancelled

    def __next__(self) -> str | GenerationResult:
        return next(self._items)

    def cancel(self) -> None:
        self._cancelled.set()


@dataclass(eq=False)
class Entry:
    """A submitted request and the channel to its caller."""

    request: Request
    batched: bool
    tokens: TokenChannel = field(default_factory=TokenChannel)
