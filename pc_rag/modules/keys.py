"""Keys of stored modules: what made the KV, and which chunk it is.

A key names the model (its fingerprint), the encoding (preamble, chunking, start position, conditioning,
splice adapter encoding side, storage dtype, codec tables and level) and the chunk's content (a hash of its
token ids), so a store only ever finds KV made exactly the way it would make it: two stores that share a
backend exchange modules only when they would have encoded them identically.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

KEY_VERSION = "v1"


@dataclass(frozen=True)
class Encoding:
    """Everything besides the model and the chunk's tokens that decides a module's stored bytes."""

    preamble_hash: str
    chunk_tokens: int
    overlap_tokens: int
    start_position: int
    conditioned: bool
    storage: str  # a dtype name ("bfloat16"), or "cachegen:<table digest>:<level>"
    encoder: str = ""  # the splice adapter encoding side chunks are encoded with (its encoding_digest); "": none

    @property
    def digest(self) -> str:
        fields = asdict(self)
        if not self.encoder:  # plain-model modules keep the keys they had before encoders existed
            del fields["encoder"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class ModuleKey:
    """One chunk's module under one model and encoding."""

    model_fingerprint: str
    encoding: Encoding
    content_hash: str

    @classmethod
    def of(cls, model_fingerprint: str, encoding: Encoding, token_ids: Sequence[int]) -> ModuleKey:
        """The key of the chunk whose tokens are ``token_ids``."""
        return cls(model_fingerprint, encoding, content_hash(token_ids))

    @property
    def name(self) -> str:
        """The backend key: ``pc-rag/v1/<model>/<encoding digest>/<content hash>``."""
        return f"pc-rag/{KEY_VERSION}/{self.model_fingerprint}/{self.encoding.digest}/{self.content_hash}"


def content_hash(token_ids: Sequence[int]) -> str:
    """sha256 of the token ids as little-endian int32s (the chunk's content, as the model reads it)."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<i4").tobytes()).hexdigest()
