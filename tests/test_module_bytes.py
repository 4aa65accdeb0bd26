"""A module's KV as module-store bytes: raw (safetensors) and CacheGen, round trips and refusals."""

from __future__ import annotations

import pytest
import torch

from pc_rag.codec import CacheGenCodec
from pc_rag.codec.tables import fit_tables
from pc_rag.errors import ModuleCorruptedError
from pc_rag.kv import SpanKV
from pc_rag.modules.serialize import module_bytes, module_span


def _span(length: int = 20, seed: int = 0) -> SpanKV:
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, 3, 2, length, 8, generator=g)
    return SpanKV(keys, values, torch.arange(100, 100 + length))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_raw_modules_round_trip_in_their_storage_dtype(dtype: torch.dtype) -> None:
    span = _span()
    back = module_span(module_bytes(span, dtype=dtype), "k", dtype=torch.float32)
    assert torch.equal(back.keys, span.keys.to(dtype).float())
    assert torch.equal(back.values, span.values.to(dtype).float()) and torch.equal(back.positions, span.positions)


def test_compressed_modules_are_the_codecs_bytes() -> None:
    codec = CacheGenCodec(fit_tables([(s.keys, s.values) for s in (_span(64, i) for i in range(4))], "test-model"))
    span = _span(40, 9)
    data = module_bytes(span, dtype=torch.float32, codec=codec, level=3)
    assert data == codec.encode(span, 3)
    back = module_span(data, "k", dtype=torch.float32, codec=codec)
    assert torch.equal(back.keys, codec.decode(data).keys) and torch.equal(back.positions, span.positions)
    with pytest.raises(ModuleCorruptedError, match="module k is not valid CacheGen bytes"):
        module_span(data[:-3], "k", dtype=torch.float32, codec=codec)


def test_bytes_that_are_not_a_module_are_refused() -> None:
    with pytest.raises(ModuleCorruptedError, match="not a safetensors module"):
        module_span(b"not safetensors", "k", dtype=torch.float32)
    from safetensors.torch import save

    with pytest.raises(ModuleCorruptedError, match="holds tensors"):
        module_span(save({"x": torch.zeros(2)}), "k", dtype=torch.float32)
    bad = {"keys": torch.zeros(3, 2, 5, 8), "values": torch.zeros(3, 2, 5, 8), "positions": torch.arange(4)}
    with pytest.raises(ModuleCorruptedError, match="inconsistent shapes"):
        module_span(save(bad), "k", dtype=torch.float32)
