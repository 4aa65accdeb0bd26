"""Wall-clock timing for benchmarks: a warm-up call, then the seconds of each timed call."""

from __future__ import annotations

import time
from collections.abc import Callable


def timed_runs(run: Callable[[], object], repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``run``, after one untimed call (compiles, first-touch allocations,
    lazy loads)."""
    run()
    seconds = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - began)
    return seconds
