"""Threads for a machine that is doing something else: use the cores other processes leave free.

A parallel region of two threads waits at every barrier for its slowest thread; on a two-core laptop where
another process holds a core, the preempted thread makes each region wait a scheduler slice (measured: cached
TTFT from 0.2 s to 4-8 s under a second heavy job, decode 2x slower at two threads than at one). ``FreeCores``
reads the CPU time the whole machine and this process spent since its last look (``/proc/stat`` and
``time.process_time``, no sleeping) and sets torch's threads to the cores the others left idle. The CLI and its
server turn it on unless given a count (``pc-rag --threads N``); a library should not change a process's thread
count on its own, so in Python it is opt-in (``use_free_cores()``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch

STAT = Path("/proc/stat")
MIN_INTERVAL_S = 0.05
"""Shorter windows are noise: the previous choice stands."""
ADAPT_EVERY = 8
"""Decode steps between two looks at the free cores, on every decode path (alone and batched)."""


class FreeCores:
    """``adapt()`` sets torch's threads to the cores free of other processes (at least 1, at most ``cores``)."""

    def __init__(self, cores: int | None = None) -> None:
        self.cores = cores or len(os.sched_getaffinity(0))
        self._lock = threading.Lock()
        self._last = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        """(wall seconds, machine busy CPU seconds, this process's CPU seconds), or None without /proc/stat."""
        try:
            fields = STAT.read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return None
        ticks = [int(f) for f in fields]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
        hz = os.sysconf("SC_CLK_TCK")
        return time.monotonic(), (sum(ticks[:8]) - idle) / hz, time.process_time()

    def others_busy(self) -> float | None:
        """Cores other processes kept busy since the last look (None: too soon, or no /proc/stat)."""
        now = self._sample()
        with self._lock:
            last = self._last
            if now is None or last is None or now[0] - last[0] < MIN_INTERVAL_S:
                return None
            self._last = now
        wall, busy, own = (a - b for a, b in zip(now, last, strict=True))
        return max(0.0, (busy - own) / wall)

    def adapt(self) -> int:
        """Set and return torch's thread count for the load seen since the last call."""
        others = self.others_busy()
        if others is not None:
            threads = max(1, min(self.cores, self.cores - round(others)))
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        return torch.get_num_threads()


_POLICY: FreeCores | None = None


def use_free_cores(enabled: bool = True) -> None:
    """Turn the policy on (or off) for this process: requests and decode steps call ``adapt_threads``."""
    global _POLICY
    _POLICY = FreeCores() if enabled else None


def free_cores_used() -> bool:
    """Whether the policy is on in this process."""
    return _POLICY is not None


def adapt_threads() -> None:
    """Adapt torch's threads to the free cores when the policy is on; nothing otherwise."""
    if _POLICY is not None:
        _POLICY.adapt()


def adapt_threads_at(step: int) -> None:
    """``adapt_threads`` every ``ADAPT_EVERY`` decode steps (``step`` counts them from 1): the one pace for a
    request decoded alone and for the scheduler's batched step, so neither keeps a thread count the machine's
    load no longer leaves it."""
    if step % ADAPT_EVERY == 0:
        adapt_threads()
