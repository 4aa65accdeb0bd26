"""Per-chunk checksums of KV shards: which chunks of a damaged shard are still intact.

A shard record of manifest format 5 lists, beside the sha256 of the whole file, one sha256 per chunk over that
chunk's tensors (``c.k``, ``c.v``, ``c.pos``, or its CacheGen ``c.lN``: name, dtype, shape and bytes, in name
order). When the file's checksum fails, the shard is read chunk by chunk: intact chunks are still served, a
damaged one is named. Records of older formats have no per-chunk sums: any damage loses the whole shard. This
module knows nothing about manifests or stores: tensors and open shards arrive from ``kvstore``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open


def chunk_digests(tensors: Mapping[str, torch.Tensor], chunk_ids: Sequence[int]) -> tuple[str, ...]:
    """The sha256 of each of ``chunk_ids``' tensors in ``tensors`` (named ``"<chunk id>.<part>"``), in order."""
    by_chunk: dict[int, dict[str, torch.Tensor]] = {int(c): {} for c in chunk_ids}
    for name, tensor in tensors.items():
        by_chunk[int(name.split(".", 1)[0])][name] = tensor
    return tuple(_digest(by_chunk[int(c)]) for c in chunk_ids)


def chunk_digest(handle: Any, chunk_id: int) -> str | None:
    """The sha256 of ``chunk_id``'s tensors in an open shard, or None if they cannot be read."""
    names = [n for n in handle.keys() if n.split(".", 1)[0] == str(chunk_id)]  # noqa: SIM118 - not iterable
    if not names:
        return None
    try:
        return _digest({n: handle.get_tensor(n) for n in names})
    except (SafetensorError, OSError, RuntimeError):
        return None


def damaged_chunks(path: Path, chunk_ids: Sequence[int], digests: Sequence[str]) -> list[int]:
    """Those of ``chunk_ids`` whose tensors in the shard at ``path`` do not match ``digests`` (all of them when the
    shard is missing, cannot be opened, or no digests were recorded)."""
    if len(digests) != len(chunk_ids) or not path.is_file():
        return list(chunk_ids)
    try:
        handle = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError):
        return list(chunk_ids)
    return [c for c, want in zip(chunk_ids, digests, strict=True) if chunk_digest(handle, c) != want]


def _digest(tensors: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype!s}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
