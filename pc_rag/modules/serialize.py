"""A module's KV as the bytes a module store keeps: raw tensors as safetensors, or CacheGen bytes at a level.

Raw KV goes through ``safetensors`` (keys, values and positions, in the storage dtype); compressed KV is the
codec's own chunk format, which carries its level, positions and checksum. Nothing is pickled. Bytes of the
wrong kind, shape or dtype raise ``ModuleCorruptedError`` naming the key.
"""

from __future__ import annotations

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from pc_rag.codec import CacheGenCodec
from pc_rag.errors import CodecError, ModuleCorruptedError
from pc_rag.kv import SpanKV

_NAMES = ("keys", "values", "positions")


def module_bytes(span: SpanKV, *, dtype: torch.dtype, codec: CacheGenCodec | None = None, level: int = 0) -> bytes:
    """``span`` stored in ``dtype`` (raw), or compressed by ``codec`` at ``level``."""
    if codec is not None:
        return codec.encode(span, level)
    tensors = {"keys": span.keys.to("cpu", dtype).contiguous(), "values": span.values.to("cpu", dtype).contiguous(),
               "positions": span.positions.to("cpu", torch.int64).contiguous()}  # fmt: skip
    return save(tensors)


def module_span(data: bytes, key: str, *, dtype: torch.dtype, codec: CacheGenCodec | None = None) -> SpanKV:
    """The span ``module_bytes`` stored under ``key``, in ``dtype``."""
    if codec is not None:
        try:
            return codec.decode(data, dtype=dtype)
        except CodecError as e:
            raise ModuleCorruptedError(f"module {key} is not valid CacheGen bytes: {e}") from e
    try:
        tensors = load(data)
    except SafetensorError as e:
        raise ModuleCorruptedError(f"module {key} is not a safetensors module: {e}") from e
    if set(tensors) != set(_NAMES):
        raise ModuleCorruptedError(f"module {key} holds tensors {sorted(tensors)}, not {list(_NAMES)}")
    keys, values, positions = (tensors[n] for n in _NAMES)
    if keys.shape != values.shape or keys.dim() != 4 or positions.shape != (keys.shape[2],):
        msg = f"module {key} has inconsistent shapes: keys {tuple(keys.shape)}, values {tuple(values.shape)}, "
        raise ModuleCorruptedError(msg + f"positions {tuple(positions.shape)}")
    return SpanKV(keys.to(dtype), values.to(dtype), positions)
