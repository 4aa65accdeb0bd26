"""The CacheGen codec: one chunk's ``SpanKV`` to self-describing compressed bytes and back.

Bytes: a fixed header (format, level, shape, counts, first position, the table digest), the positions
if they are not consecutive, the indices of the tokens kept exactly, (format 2:) for each the index of the
tables' ``shared`` token it equals or 255, the values (float16 if they fit, else float32) of the others, the
escapes (uint32 flat index, int16 remainder; format 2), the rANS words, and a blake2b checksum of everything
before it. Format 1 (no shared tokens, no escapes) still decodes.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import torch

from pc_rag.codec.quantize import Escapes, coded_columns, quantize, reconstruct
from pc_rag.codec.tables import CodecTables
from pc_rag.errors import CodecCorruptedError, CodecError
from pc_rag.kv import SpanKV

MAGIC = b"PCKV"
FORMAT = 2
# magic, format, level, consecutive positions, raw dtype, layers, heads, head dim, length, raw tokens, words,
# (format 2: escapes,) first position, table digest
_HEADERS = {1: struct.Struct("<4sBBBBHHHxxIIIq16s"), 2: struct.Struct("<4sBBBBHHHxxIIIIq16s")}
_HEADER = _HEADERS[FORMAT]
_RAW_DTYPES = (np.float32, np.float16)  # exact tokens: float16 when every value fits its range
_CHECKSUM_BYTES = 8
_FLOAT16_MAX = float(np.finfo(np.float16).max)
_FLOAT16_EPSILON = 2.0**-11  # float16's relative rounding error
_STORED = 255  # an exact token stored in the chunk, not one of the tables' shared tokens


class CacheGenCodec:
    """Compresses spans with ``tables`` (which must be this model's)."""

    def __init__(self, tables: CodecTables) -> None:
        self.tables = tables
        self._scales: dict[int, np.ndarray] = {}

    def encode(self, span: SpanKV, level: int) -> bytes:
        """``span`` at quality ``level`` as bytes."""
        layers, heads, length, dim = span.keys.shape
        self._check_shape(layers, heads, dim)
        lv = self.tables.level(level)
        x = torch.stack([span.keys.detach(), span.values.detach()]).to("cpu", torch.float32)
        q = quantize(x, self.tables.transform, lv.step, lv.limit)
        words = self.tables.coder(level).encode(q.symbols)
        positions = span.positions.to("cpu", torch.int64)
        first = int(positions[0]) if length else 0
        consecutive = bool(torch.equal(positions, torch.arange(first, first + length)))
        refs = self._references(x[:, :, :, q.raw])
        raw = x[:, :, :, q.raw[torch.from_numpy(refs == _STORED)]]
        raw_dtype = int(bool(raw.numel() == 0 or raw.abs().max() <= _FLOAT16_MAX))
        escapes = q.escapes
        if escapes.index.numel() and int(escapes.index[-1]) > np.iinfo(np.uint32).max:
            raise CodecError(f"a span of {length} tokens is too long for one compressed chunk")
        header = _HEADER.pack(MAGIC, FORMAT, level, consecutive, raw_dtype, layers, heads, dim, length, q.raw.numel(),
                              len(words), escapes.index.numel(), first, self.tables.digest.encode())  # fmt: skip
        parts = [
            header,
            b"" if consecutive else positions.numpy().tobytes(),
            q.raw.to(torch.int32).numpy().tobytes(),
            refs.tobytes(),
            raw.numpy().astype(_RAW_DTYPES[raw_dtype]).tobytes(),
            escapes.index.numpy().astype(np.uint32).tobytes(),
            escapes.remainder.numpy().tobytes(),
            words.tobytes(),
        ]
        body = b"".join(parts)
        return body + _checksum(body)

    def decode(self, blob: bytes | memoryview, *, dtype: torch.dtype = torch.float32) -> SpanKV:
        """The span ``encode`` compressed into ``blob``, in ``dtype``; ``CodecCorruptedError`` if damaged."""
        view = memoryview(blob)
        shortest = min(h.size for h in _HEADERS.values()) + _CHECKSUM_BYTES
        if len(view) < shortest or _checksum(view[:-_CHECKSUM_BYTES]) != view[-_CHECKSUM_BYTES:]:
            raise CodecCorruptedError("compressed KV fails its checksum: the bytes are damaged or truncated")
        magic, fmt = struct.unpack_from("<4sB", view)
        if magic != MAGIC or fmt not in _HEADERS or len(view) < _HEADERS[fmt].size + _CHECKSUM_BYTES:
            msg = f"not compressed KV of formats {sorted(_HEADERS)} (magic {magic!r}, format {fmt})"
            raise CodecCorruptedError(msg)
        fields = list(_HEADERS[fmt].unpack_from(view))
        if fmt == 1:
            fields.insert(11, 0)  # no escapes
        (_, _, level, consecutive, raw_dtype, layers, heads, dim, length, n_raw, n_words, n_escapes, first,
         digest) = fields  # fmt: skip
        if raw_dtype >= len(_RAW_DTYPES):
            raise CodecCorruptedError(f"compressed KV names an unknown dtype {raw_dtype} for its exact tokens")
        if digest.decode() != self.tables.digest:
            msg = f"this chunk was compressed with CacheGen tables {digest.decode()}, these are {self.tables.digest}"
            raise CodecError(msg)
        self._check_shape(layers, heads, dim)
        reader = _Reader(view, _HEADERS[fmt].size)
        positions = torch.arange(first, first + length) if consecutive else reader.take(np.int64, (length,))
        raw = reader.take(np.int32, (n_raw,)).long()
        refs = reader.take(np.uint8, (n_raw,)) if fmt >= 2 else torch.full((n_raw,), _STORED, dtype=torch.uint8)
        stored = refs == _STORED
        raw_values = torch.empty(2, layers, heads, n_raw, dim)
        kept = reader.take(_RAW_DTYPES[raw_dtype], (2, layers, heads, int(stored.sum()), dim))
        raw_values[:, :, :, stored] = kept.float()
        if not bool(stored.all()):
            shared = self.tables.shared
            if shared is None or int(refs[~stored].max()) >= len(shared):
                raise CodecCorruptedError("compressed KV names a shared token its tables do not have: it is damaged")
            raw_values[:, :, :, ~stored] = shared[refs[~stored].long()].permute(1, 2, 3, 0, 4)
        escapes = Escapes(reader.take(np.uint32, (n_escapes,)).long(), reader.take(np.int16, (n_escapes,)))
        words = reader.rest(np.uint16, n_words, len(view) - _CHECKSUM_BYTES)
        if raw.numel() and (int(raw[0]) < 0 or int(raw[-1]) >= length or bool((raw.diff() <= 0).any())):
            raise CodecCorruptedError("compressed KV names exact tokens outside its length: the bytes are damaged")
        columns = coded_columns(raw, length)
        if n_escapes and int(escapes.index.max()) >= 2 * layers * heads * dim * columns.numel():
            raise CodecCorruptedError("compressed KV has an escape outside its symbols: the bytes are damaged")
        c = np.empty((2, layers, heads, dim, length), np.float32)
        scale = self._scale(level)
        self.tables.coder(level).decode_into(words, c, columns.numpy(), scale)
        escapes.add_to(torch.from_numpy(c).view(-1, length), columns, torch.from_numpy(scale).flatten())
        x = reconstruct(torch.from_numpy(c), raw, self.tables.transform, raw_values)
        return SpanKV(x[0].to(dtype), x[1].to(dtype), positions)

    def _references(self, raw: torch.Tensor) -> np.ndarray:
        """For each exact token of ``raw`` [2, L, H, n, D], the index of the tables' ``shared`` token it equals (to
        float16's precision, at which it would be stored otherwise), or ``_STORED``: uint8 [n]."""
        refs = np.full(raw.shape[3], _STORED, np.uint8)
        shared = self.tables.shared
        if shared is None or not raw.numel():
            return refs
        for j in range(raw.shape[3]):
            token = raw[:, :, :, j]
            close = ((token - shared).abs() <= shared.abs() * _FLOAT16_EPSILON + 1e-6).flatten(1).all(dim=1)
            if bool(close.any()):
                refs[j] = int(close.nonzero()[0])
        return refs

    def _scale(self, level: int) -> np.ndarray:
        """Each lane's quantization step at ``level`` [2, L, H, D] (float32)."""
        if level not in self._scales:
            steps = self.tables.transform.steps(self.tables.level(level).step)[..., 0]  # [2, L, H, 1]
            self._scales[level] = np.ascontiguousarray(steps.expand(*steps.shape[:3], self.tables.shape[2]).numpy())
        return self._scales[level]

    def _check_shape(self, layers: int, heads: int, dim: int) -> None:
        if (layers, heads, dim) != self.tables.shape:
            msg = (
                f"KV of {layers} layers x {heads} heads x {dim} dims does not fit CacheGen tables "
                f"{self.tables.digest} ({' x '.join(map(str, self.tables.shape))}): tables of another model"
            )
            raise CodecError(msg)


class _Reader:
    """Consecutive arrays out of a byte view, with a clear error instead of a short read."""

    def __init__(self, view: memoryview, offset: int) -> None:
        self.view, self.offset = view, offset

    def take(self, dtype: type, shape: tuple[int, ...]) -> torch.Tensor:
        count = int(np.prod(shape))
        end = self.offset + count * np.dtype(dtype).itemsize
        if end > len(self.view):
            raise CodecCorruptedError("compressed KV is shorter than its header says: the bytes are damaged")
        out = np.frombuffer(self.view, dtype, count, self.offset).reshape(shape)
        self.offset = end
        return torch.from_numpy(out.copy())

    def rest(self, dtype: type, count: int, end: int) -> np.ndarray:
        if self.offset + count * np.dtype(dtype).itemsize != end:
            raise CodecCorruptedError("compressed KV has an inconsistent length: the header and the body disagree")
        return np.frombuffer(self.view, dtype, count, self.offset)


def _checksum(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=_CHECKSUM_BYTES).digest()
