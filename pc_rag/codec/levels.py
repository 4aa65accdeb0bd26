"""CacheGen quality levels: the quantization step of each, in units of a head's RMS. Higher levels keep more.

This module knows nothing about tensors or entropy coding.
"""

from __future__ import annotations

from dataclasses import dataclass

from pc_rag.errors import CodecError

LIMIT = 127  # symbols are int8: a token with a coefficient beyond LIMIT steps is kept exactly instead


class UnknownLevelError(CodecError, ValueError):
    """A CacheGen level that is not defined."""


@dataclass(frozen=True)
class Level:
    """Quantization ``step`` (x the head's RMS) and the symbol range ``[-limit, limit]`` of one level."""

    number: int
    step: float
    limit: int = LIMIT


# Steps chosen on the tuning split (examples/results/codec_metric.json) for tables fitted in the keys' query metric:
# there step 0.6 costs 3.2 KB/token (ideal) at first-token KL 0.006, 0.7 already 0.014. Level 5 was 0.25 before
# tables had a step allocation; under its finest factor (0.35) that left 12% of tokens beyond the symbol range.
LEVELS: dict[int, Level] = {lv.number: lv for lv in (Level(1, 1.0), Level(2, 0.8), Level(3, 0.6), Level(4, 0.45),
                                                     Level(5, 0.3))}  # fmt: skip
# On all 554 dev questions (examples/results/codec_dev_all.json) only level 5 keeps the default mode's first token
# on ~97% of answers (96.6%; level 4: 92.8%) at codec KL 0.0048, with F1 unchanged within its interval.
DEFAULT_LEVEL = 5


def level(number: int) -> Level:
    """The level numbered ``number``; ``UnknownLevelError`` naming the known ones otherwise."""
    try:
        return LEVELS[number]
    except KeyError:
        msg = f"CacheGen level {number} is not defined; levels: {', '.join(map(str, LEVELS))} (higher keeps more)"
        raise UnknownLevelError(msg) from None
