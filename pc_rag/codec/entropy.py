"""Entropy coding of quantized KV symbols with fixed probability models (CacheGen section 5.3).

One model per lane: (keys|values, layer, head, component), fitted once per model and level (``tables``),
never shipped with a chunk. Coding is asymmetric numeral systems from ``constriction``: a chunk is one
stream of 32-bit words; each lane's symbols are one contiguous run, so a chunk costs one call into the
coder per lane, not per symbol.
"""

from __future__ import annotations

import constriction
import numpy as np
import torch

from pc_rag.errors import CodecCorruptedError

AnsCoder = constriction.stream.stack.AnsCoder  # a compiled module: its submodules are attributes, not imports
Categorical = constriction.stream.model.Categorical


class SymbolCoder:
    """Codes symbols [2, L, H, S, D] in ``[-limit, limit]`` to ANS words and back, with ``probabilities``
    [2, L, H, D, 2 * limit + 1] (unnormalized) over ``symbol + limit``."""

    def __init__(self, probabilities: np.ndarray, limit: int) -> None:
        self.limit = limit
        self.shape = probabilities.shape[:4]
        flat = probabilities.reshape(-1, probabilities.shape[-1]).astype(np.float64)
        self._models = [Categorical(np.ascontiguousarray(row), perfect=False) for row in flat]

    def encode(self, symbols: torch.Tensor) -> np.ndarray:
        """The ANS words (uint32) of ``symbols`` [2, L, H, S, D] int8."""
        lanes = self._lanes(symbols)
        coder = AnsCoder()
        for lane in reversed(range(len(self._models))):  # a stack: encode backwards so decoding runs forwards
            coder.encode_reverse(lanes[lane], self._models[lane])
        return coder.get_compressed()

    def decode(self, words: np.ndarray, length: int) -> torch.Tensor:
        """The symbols [2, L, H, length, D] int8 that ``encode`` turned into ``words``."""
        lanes = np.empty((len(self._models), length), dtype=np.int32)
        coder = AnsCoder(words)
        try:
            for lane, model in enumerate(self._models):
                lanes[lane] = coder.decode(model, length)
        except (ValueError, RuntimeError) as e:
            raise CodecCorruptedError(f"compressed KV does not decode: {e}") from e
        if not coder.is_empty():
            raise CodecCorruptedError("compressed KV has words left over after decoding: the bytes are damaged")
        lanes -= self.limit
        return torch.from_numpy(lanes).to(torch.int8).view(*self.shape, length).transpose(3, 4)

    def _lanes(self, symbols: torch.Tensor) -> np.ndarray:
        if (*symbols.shape[:3], symbols.shape[4]) != tuple(self.shape):
            msg = f"symbols of shape {tuple(symbols.shape)} do not fit models of shape {self.shape}"
            raise ValueError(msg)
        lanes = symbols.transpose(3, 4).reshape(len(self._models), -1).to(torch.int32) + self.limit
        return lanes.numpy()
