"""Reading and decoding many chunks at once: on as many threads as torch uses (both release the GIL)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


def map_threads(fn: Callable[[T], R], items: Sequence[T], prefix: str) -> list[R]:
    """``fn`` of each of ``items``, in order; on one thread when there is one item or torch uses one."""
    workers = min(len(items), torch.get_num_threads())
    if workers <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(workers, thread_name_prefix=prefix) as pool:
        return list(pool.map(fn, items))
