"""Wall-clock timing for benchmarks: a warm-up call, then the seconds of each timed call; the read bandwidth a
step's floor is counted against."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


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


def read_bandwidth_gb_s(gib: float = 1.0, runs: int = 7) -> float:
    """Bytes per second that ``sum`` reads from a tensor far larger than the caches."""
    x = torch.ones(int(gib * 2**30 / 4))
    x.sum()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9
