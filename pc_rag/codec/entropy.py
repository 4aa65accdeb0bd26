"""Entropy coding of quantized KV symbols with fixed probability models (CacheGen section 5.3).

One model per lane: (keys|values, layer, head, component), fitted once per model and level (``tables``),
never shipped with a chunk. Coding is interleaved rANS (``rans``): a chunk is one stream of 16-bit
words; each lane's symbols are one contiguous run.
"""

from __future__ import annotations

import numpy as np
import torch

from pc_rag.codec import rans
from pc_rag.errors import CodecCorruptedError


class SymbolCoder:
    """Codes symbols [2, L, H, S, D] in ``[-limit, limit]`` to rANS words and back, with frequencies ``freq``
    [2, L, H, D, 2 * limit + 1] over ``symbol + limit`` (``rans.quantize_probabilities``)."""

    def __init__(self, freq: np.ndarray, limit: int) -> None:
        self.limit = limit
        self.shape = tuple(freq.shape[:4])
        self.lanes = int(np.prod(self.shape))
        self._freq, self._cum, self._lut = rans.decoding_tables(freq.reshape(self.lanes, -1))

    def encode(self, symbols: torch.Tensor) -> np.ndarray:
        """The rANS words (uint16) of ``symbols`` [2, L, H, S, D] int8."""
        if (*symbols.shape[:3], symbols.shape[4]) != self.shape:
            msg = f"symbols of shape {tuple(symbols.shape)} do not fit models of shape {self.shape}"
            raise ValueError(msg)
        if symbols.numel() and int(symbols.abs().max()) > self.limit:
            raise ValueError(f"symbols exceed the coder's range [-{self.limit}, {self.limit}]")
        lanes = symbols.transpose(3, 4).reshape(self.lanes, -1).to(torch.int32) + self.limit
        return rans.encode(np.ascontiguousarray(lanes.numpy()), self._freq, self._cum)

    def decode_into(self, words: np.ndarray, out: np.ndarray, columns: np.ndarray, scale: np.ndarray) -> None:
        """Decode ``words`` into ``out`` [2, L, H, D, S] (float32, C-contiguous): each lane's symbols, times its
        ``scale`` [2, L, H, D], at token ``columns`` (int64, one per coded token); other tokens are left alone."""
        if not out.flags.c_contiguous or out.dtype != np.float32:
            raise ValueError("symbols decode into a C-contiguous float32 array")
        lanes = out.reshape(self.lanes, out.shape[-1])
        used = rans.decode(words, self._freq, self._cum, self._lut, self.limit, scale.reshape(-1), columns, lanes)
        if used != len(words):
            raise CodecCorruptedError("compressed KV does not decode to its length: the bytes are damaged")

    def decode(self, words: np.ndarray, length: int) -> torch.Tensor:
        """The symbols [2, L, H, length, D] (int16) that ``encode`` turned into ``words``."""
        out = np.empty((*self.shape, length), np.float32)
        self.decode_into(words, out, np.arange(length), np.ones(self.shape, np.float32))
        return torch.from_numpy(out).transpose(3, 4).to(torch.int16)
