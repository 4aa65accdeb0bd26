"""Modes over chunks stored another way in an eval: ``<mode>@cachegen:<level>`` and ``<mode>@<dtype>``.

Such a mode answers like ``<mode>`` from the same chunks after a round trip through storage: the
CacheGen codec at ``level``, or rounding the KV to ``dtype`` (``bfloat16``, ``float16``) and reading it
back in the dtype it was encoded in, as a store with that storage dtype does. Its records are compared
with ``<mode>`` on the chunks as encoded (first-token KL and agreement; F1 change at aggregation).
This module knows nothing about models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pc_rag.errors import EvalError

SEPARATOR = "@cachegen:"
STORED = "@"  # what every stored-variant mode name has after its base mode
KV_DTYPES = ("float32", "bfloat16", "float16")  # pc_rag.store.kvstore.STORAGE_DTYPES, without importing torch


def split_codec_mode(mode: str) -> tuple[str, int | None]:
    """(the recovery mode, the CacheGen level or None) of an eval mode name."""
    base, sep, level = mode.partition(SEPARATOR)
    if not sep:
        return mode, None
    if not level.isdigit():
        msg = f"mode {mode!r}: the CacheGen level after {SEPARATOR!r} must be a number"
        raise EvalError(msg)
    return base, int(level)


def split_dtype_mode(mode: str) -> tuple[str, str | None]:
    """(the recovery mode, the KV storage dtype or None) of an eval mode name; CacheGen modes have no dtype."""
    base, sep, dtype = mode.partition(STORED)
    if not sep or mode.startswith(base + SEPARATOR):
        return mode, None
    if dtype not in KV_DTYPES:
        msg = f"mode {mode!r}: after {STORED!r} comes cachegen:<level> or a KV dtype ({', '.join(KV_DTYPES)})"
        raise EvalError(msg)
    return base, dtype


def base_mode(mode: str) -> str:
    """The recovery mode of an eval mode name (itself unless it is a stored variant)."""
    return mode.partition(STORED)[0]


def with_codec(modes: Sequence[str], levels: Sequence[int]) -> list[str]:
    """``modes`` with each cached mode followed by its compressed twins at ``levels`` (``full`` has none)."""
    return with_stored(modes, [f"cachegen:{level}" for level in levels])


def with_kv_dtypes(modes: Sequence[str], dtypes: Sequence[str]) -> list[str]:
    """``modes`` with each cached mode followed by its twins stored in ``dtypes``; ``EvalError`` for others."""
    unknown = [d for d in dtypes if d not in KV_DTYPES]
    if unknown or not dtypes:
        what = f"unknown KV storage dtype(s) {', '.join(map(repr, unknown))}" if unknown else "no KV storage dtype"
        msg = f"{what}; known: {', '.join(KV_DTYPES)}"
        raise EvalError(msg)
    return with_stored(modes, dtypes)


def with_stored(modes: Sequence[str], variants: Sequence[str]) -> list[str]:
    """``modes`` with each cached base mode followed by ``<mode>@<variant>`` for each of ``variants``, once each."""
    out = []
    for mode in modes:
        out.append(mode)
        if mode != "full" and base_mode(mode) == mode:
            out += [f"{mode}{STORED}{variant}" for variant in variants]
    return list(dict.fromkeys(out))


def stored(chunks: Sequence[Any], mode: str, codec: Any | None) -> list[Any]:
    """``chunks`` as ``mode`` reads them: round-tripped through its codec level or storage dtype (or as given)."""
    _, level = split_codec_mode(mode)
    if level is not None:
        return compressed(chunks, codec, level)
    _, dtype = split_dtype_mode(mode)
    return list(chunks) if dtype is None else stored_in(chunks, dtype)


def stored_in(chunks: Sequence[Any], dtype: str) -> list[Any]:
    """``chunks`` with their KV rounded to ``dtype`` and read back in its own dtype, as a store in ``dtype`` does
    (without a ``source``, as in ``compressed``)."""
    import torch

    storage = getattr(torch, dtype)
    out = []
    for chunk in chunks:
        kv = chunk.kv  # keys, values: [L, H_kv, S, D]
        keys, values = kv.keys.to(storage).to(kv.keys.dtype), kv.values.to(storage).to(kv.values.dtype)
        out.append(replace(chunk, kv=replace(kv, keys=keys, values=values), source=None))
    return out


def compressed(chunks: Sequence[Any], codec: Any, level: int) -> list[Any]:
    """``chunks`` (``pc_rag.rag.engine.Chunk``) with their KV replaced by its decoding at ``level``.

    Like ``stored_in``, the copies have no ``source``: a store's chunk keeps one, and the engine would share
    its KV as stored with requests that place the same source at the same positions.
    """
    out = []
    for chunk in chunks:
        kv = codec.decode(codec.encode(chunk.kv, level), dtype=chunk.kv.keys.dtype)
        kv = replace(kv, keys=kv.keys.to(chunk.kv.keys.device), values=kv.values.to(chunk.kv.values.device))
        out.append(replace(chunk, kv=kv, source=None))
    return out
