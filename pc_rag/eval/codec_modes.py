"""Modes over CacheGen-compressed chunks in an eval: ``<mode>@cachegen:<level>``.

Such a mode answers like ``<mode>`` from the same chunks after a round trip through the codec at
``level``, and its records are compared with ``<mode>`` on uncompressed chunks (first-token KL and
agreement; F1 change at aggregation). This module knows nothing about models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pc_rag.errors import EvalError

SEPARATOR = "@cachegen:"


def split_codec_mode(mode: str) -> tuple[str, int | None]:
    """(the recovery mode, the CacheGen level or None) of an eval mode name."""
    base, sep, level = mode.partition(SEPARATOR)
    if not sep:
        return mode, None
    if not level.isdigit():
        msg = f"mode {mode!r}: the CacheGen level after {SEPARATOR!r} must be a number"
        raise EvalError(msg)
    return base, int(level)


def with_codec(modes: Sequence[str], levels: Sequence[int]) -> list[str]:
    """``modes`` with each cached mode followed by its compressed twins at ``levels`` (``full`` has none)."""
    out = []
    for mode in modes:
        out.append(mode)
        if mode != "full":
            out += [f"{mode}{SEPARATOR}{level}" for level in levels]
    return out


def compressed(chunks: Sequence[Any], codec: Any, level: int) -> list[Any]:
    """``chunks`` (``pc_rag.rag.engine.Chunk``) with their KV replaced by its decoding at ``level``."""
    out = []
    for chunk in chunks:
        kv = codec.decode(codec.encode(chunk.kv, level), dtype=chunk.kv.keys.dtype)
        out.append(replace(chunk, kv=replace(kv, keys=kv.keys.to(chunk.kv.keys.device),
                                             values=kv.values.to(chunk.kv.values.device))))  # fmt: skip
    return out
