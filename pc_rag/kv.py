"""Cached attention state of one span, and the preallocated cache that spans are spliced into.

Shapes: a span's keys and values are ``[L, H_kv, S, D]`` for L layers; keys are
stored *after* RoPE at ``positions`` (absolute). The serving cache is one buffer
``[L, B, H_kv, capacity, D]`` per keys/values whose layer views transformers
writes into, so neither splicing nor decoding re-concatenates the cache. This
module knows nothing about PML or tokenizers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer


@dataclass
class SpanKV:
    """Keys/values of one span: ``keys``/``values`` [L, H_kv, S, D], ``positions`` [S] (absolute)."""

    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.positions.shape[0])

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> SpanKV:
        """Copy to ``device``/``dtype``; on a CUDA machine host copies are pinned for async transfer."""
        keys, values = self.keys.to(device, dtype), self.values.to(device, dtype)
        if torch.device(device).type == "cpu" and torch.cuda.is_available():
            keys, values = keys.pin_memory(), values.pin_memory()
        return SpanKV(keys, values, self.positions.to("cpu"))


class PreallocatedLayer(DynamicLayer):
    """A cache layer over a fixed buffer [B, H_kv, capacity, D]; ``update`` writes in place (grows if full)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int = 0) -> None:
        super().__init__()
        self._kbuf, self._vbuf, self._length = keys, values, length
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self._expose()

    def _expose(self) -> None:
        self.keys = self._kbuf[:, :, : self._length]
        self.values = self._vbuf[:, :, : self._length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = key_states.shape[-2]
        if self._length + n > self._kbuf.shape[-2]:
            grow = max(self._length + n, 2 * self._kbuf.shape[-2])
            self._kbuf = _grown(self._kbuf, grow)
            self._vbuf = _grown(self._vbuf, grow)
        self._kbuf[:, :, self._length : self._length + n] = key_states
        self._vbuf[:, :, self._length : self._length + n] = value_states
        self.advance(n)
        return self.keys, self.values

    def rebind(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Use ``keys``/``values`` [B, H_kv, capacity, D] as the buffers; they already hold the cached tokens."""
        self._kbuf, self._vbuf = keys, values
        self._expose()

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole key and value buffers [B, H_kv, capacity, D], cached tokens first."""
        return self._kbuf, self._vbuf

    def advance(self, n: int) -> None:
        """Count ``n`` tokens written in place after the cached ones (as ``BufferCache`` writers do)."""
        self._length += n
        self._expose()

    def get_seq_length(self) -> int:
        return self._length

    def crop(self, tokens_to_remove: int) -> None:
        assert tokens_to_remove <= 0, "crop takes a negative count"
        self._length = max(0, self._length + tokens_to_remove)
        self._expose()


def _grown(buf: torch.Tensor, capacity: int) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor wherever it grows, as ``allocate`` makes them
        out = buf.new_empty(*buf.shape[:-2], capacity, buf.shape[-1])
    out[..., : buf.shape[-2], :] = buf
    return out


@dataclass(eq=False)  # identity, not tensor equality: buffers are pooled by identity
class KVBuffer:
    """One [L, B, H_kv, capacity, D] tensor each for keys and values, and the cache that views it."""

    keys: torch.Tensor
    values: torch.Tensor

    def cache(self, length: int) -> BufferCache:
        """A transformers ``Cache`` whose layer i writes into ``keys[i]``/``values[i]`` after ``length`` tokens."""
        layers = [PreallocatedLayer(self.keys[i], self.values[i], length) for i in range(self.keys.shape[0])]
        return BufferCache(self, layers)


class BufferCache(Cache):
    """The cache of one ``KVBuffer``: its layers write into the buffer's layer views while they have room."""

    def __init__(self, buffer: KVBuffer, layers: list[PreallocatedLayer]) -> None:
        super().__init__(layers=layers)
        self.buffer = buffer

    def gathered(self, room: int) -> KVBuffer:
        """The buffer, with room for ``room`` more tokens in every layer and every layer's tokens in it.

        A layer that grew on its own (transformers wrote past the capacity) and a buffer short of room are
        regrouped into one larger buffer (its tensors replaced), so one [L, ...] tensor holds the whole cache.
        """
        buffer, layers = self.buffer, self.layers
        length = max(layer.get_seq_length() for layer in layers)
        in_place = all(
            layer.buffers[0].data_ptr() == buffer.keys[i].data_ptr() and layer.buffers[0].shape[-2] >= length + room
            for i, layer in enumerate(layers)
        )
        if in_place:
            return buffer
        keys = buffer.keys
        capacity = max(length + room, 2 * keys.shape[-2])
        grown = _allocate((*keys.shape[:-2], capacity, keys.shape[-1]), keys.dtype, keys.device)
        for i, layer in enumerate(layers):
            n = layer.get_seq_length()
            for target, source in zip((grown.keys, grown.values), layer.buffers, strict=True):
                target[i, ..., :n, :] = source[..., :n, :]
            layer.rebind(grown.keys[i], grown.values[i])
        buffer.keys, buffer.values = grown.keys, grown.values
        return buffer


def kv_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a model's attention cache."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


def allocate(model: PreTrainedModel, capacity: int, batch: int = 1) -> KVBuffer:
    """Allocate an uninitialized KV buffer for ``capacity`` tokens on the model's device and dtype."""
    layers, heads, head_dim = kv_shape(model)
    param = next(model.parameters())
    return _allocate((layers, batch, heads, capacity, head_dim), param.dtype, param.device)


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> KVBuffer:
    with torch.inference_mode(False):  # normal tensors even when allocated while serving: one kind for all buffers
        return KVBuffer(
            keys=torch.empty(shape, dtype=dtype, device=device), values=torch.empty(shape, dtype=dtype, device=device)
        )


class BufferPool:
    """Reuses KV buffers across requests.

    A fresh multi-hundred-MB buffer page-faults on first touch, which costs more
    than splicing into it; a buffer in use by a live request is never handed out.
    """

    def __init__(self, model: PreTrainedModel, keep: int = 2, granularity: int = 1024) -> None:
        self.model = model
        self.keep = keep
        self.granularity = granularity
        self._free: list[KVBuffer] = []
        self._lock = threading.Lock()

    def acquire(self, capacity: int) -> KVBuffer:
        """A buffer for at least ``capacity`` tokens (batch 1), reused when one is free."""
        with self._lock:
            fitting = [b for b in self._free if b.keys.shape[-2] >= capacity]
            if fitting:
                buffer = min(fitting, key=lambda b: b.keys.shape[-2])
                self._free.remove(buffer)
                return buffer
        rounded = -(-capacity // self.granularity) * self.granularity
        return allocate(self.model, rounded)

    def release(self, buffer: KVBuffer) -> None:
        """Return ``buffer`` for reuse; the smallest spare is dropped beyond ``keep``."""
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=lambda b: b.keys.shape[-2], reverse=True)
            del self._free[self.keep :]
