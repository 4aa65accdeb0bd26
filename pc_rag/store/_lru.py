"""A least-recently-used map bounded by the total byte size of its values.

It knows nothing about what the values are: a ``size`` function measures them.
Not thread-safe; its owner locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    """Keeps the most recently used values whose sizes add up to at most ``budget`` bytes."""

    def __init__(self, budget: int, size: Callable[[V], int]) -> None:
        self.budget = budget
        self._size = size
        self._items: OrderedDict[Hashable, V] = OrderedDict()
        self.nbytes = 0

    def get(self, key: Hashable) -> V | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: Hashable, value: V) -> None:
        """Insert ``value`` and evict the least recently used beyond the budget; a value above it is not kept."""
        self.pop(key)
        size = self._size(value)
        if size > self.budget:
            return
        self._items[key] = value
        self.nbytes += size
        while self.nbytes > self.budget:
            _, evicted = self._items.popitem(last=False)
            self.nbytes -= self._size(evicted)

    def pop(self, key: Hashable) -> None:
        value = self._items.pop(key, None)
        if value is not None:
            self.nbytes -= self._size(value)

    def pop_where(self, predicate: Callable[[Hashable], bool]) -> None:
        """Remove every key for which ``predicate`` is true."""
        for key in [k for k in self._items if predicate(k)]:
            self.pop(key)

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0
