"""The frame every backend stores around a module's bytes: magic, length, blake2b digest, payload.

A frame that is cut, altered or of another format is refused with ``ModuleCorruptedError``: a backend never
hands damaged bytes on as KV.
"""

from __future__ import annotations

import hashlib

from pc_rag.errors import ModuleCorruptedError

MAGIC = b"PCRM\x01"
_DIGEST = 16


def frame(payload: bytes) -> bytes:
    return MAGIC + len(payload).to_bytes(8, "little") + hashlib.blake2b(payload, digest_size=_DIGEST).digest() + payload


def unframe(data: bytes, key: str) -> bytes:
    """The payload of ``data`` stored under ``key``; ``ModuleCorruptedError`` if it does not check out."""
    head = len(MAGIC) + 8 + _DIGEST
    if len(data) < head or not data.startswith(MAGIC):
        msg = f"module {key} is not a pc-rag module frame ({len(data)} bytes)"
        raise ModuleCorruptedError(msg)
    length = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 8], "little")
    payload = data[head:]
    if len(payload) != length or hashlib.blake2b(payload, digest_size=_DIGEST).digest() != data[head - _DIGEST : head]:
        msg = f"module {key} is damaged: its checksum or length does not match ({len(payload)} of {length} bytes)"
        raise ModuleCorruptedError(msg)
    return payload
