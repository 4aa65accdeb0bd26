"""The CacheGen codec: quantization bounds, lossless entropy coding, self-describing bytes, clear errors."""

from __future__ import annotations

import pytest
import torch

from pc_rag.codec.cachegen import CacheGenCodec
from pc_rag.codec.levels import LEVELS, Level, UnknownLevelError, level
from pc_rag.codec.quantize import GROUP_TOKENS, Transform, dequantize, quantize
from pc_rag.codec.tables import CodecTables, fit_tables
from pc_rag.errors import CodecCorruptedError, CodecError
from pc_rag.kv import SpanKV

LAYERS, HEADS, DIM = 4, 2, 8


def _kv(length: int, seed: int = 0, *, smooth: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """KV shaped like a model's: correlated channels, a loud one, a loud first token; ``smooth`` along tokens."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(2, LAYERS, HEADS, DIM, DIM, generator=torch.Generator().manual_seed(99))
    z = torch.randn(2, LAYERS, HEADS, length, DIM, generator=g)
    if smooth:
        z = z.cumsum(3) * 0.3
    x = torch.matmul(z, mix) + torch.linspace(-3, 3, DIM)
    x[..., 0, :] *= 30  # an attention sink
    return x[0], x[1]


@pytest.fixture(scope="module")
def tables() -> CodecTables:
    return fit_tables([_kv(64, seed) for seed in range(6)], "test-model")


def test_the_transform_is_orthonormal_and_inverts(tables: CodecTables) -> None:
    t = tables.transform
    eye = torch.eye(DIM).expand_as(t.basis)
    torch.testing.assert_close(t.basis.transpose(-1, -2) @ t.basis, eye, atol=1e-5, rtol=0)
    x = torch.stack(_kv(20, seed=3))
    torch.testing.assert_close(t.inverse(t.forward(x)), x, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 9, 10, 11, 23, 40])
@pytest.mark.parametrize("anchored", [False, True])
def test_every_coded_coefficient_is_within_half_a_step(tables: CodecTables, length: int, anchored: bool) -> None:
    t = tables.transform
    transform = Transform(t.mean, t.basis, t.rms, torch.full_like(t.anchored, anchored))
    x = torch.stack(_kv(length, seed=length, smooth=True))
    q = quantize(x, transform, 0.5, 127)
    exact = torch.zeros(length, dtype=torch.bool)
    exact[q.raw] = True
    assert bool(exact[0]), "the first token is always kept exactly"
    out = dequantize(q, transform, 0.5, x[:, :, :, q.raw])
    error = (transform.forward(out) - transform.forward(x)).abs()  # [2, L, H, S, D]
    steps = transform.steps(0.5)
    assert bool((error <= 0.5 * steps + 1e-4).all()), float((error / steps).max())
    torch.testing.assert_close(out[:, :, :, exact], x[:, :, :, exact], atol=1e-4, rtol=1e-5)


def test_tokens_beyond_the_symbol_range_are_kept_exactly(tables: CodecTables) -> None:
    x = torch.stack(_kv(30, seed=4))
    x[:, :, :, 17] *= 1000
    q = quantize(x, tables.transform, 0.5, 20)
    assert 17 in q.raw.tolist() and 0 in q.raw.tolist()
    assert int(q.symbols.abs().max()) <= 20


def test_anchored_layers_are_chosen_where_deltas_are_cheaper() -> None:
    smooth = fit_tables([_kv(80, seed, smooth=True) for seed in range(4)], "m")
    rough = fit_tables([_kv(80, seed) for seed in range(4)], "m")
    assert bool(smooth.transform.anchored.all()) and not bool(rough.transform.anchored.any())


@pytest.mark.parametrize("smooth", [False, True])
def test_higher_levels_keep_more_and_cost_more(smooth: bool) -> None:
    tables = fit_tables([_kv(64, seed, smooth=smooth) for seed in range(6)], "test-model")
    codec = CacheGenCodec(tables)
    keys, values = _kv(100, seed=9, smooth=smooth)
    span = SpanKV(keys, values, torch.arange(7, 107))
    sizes, errors = [], []
    for number in sorted(LEVELS):
        blob = codec.encode(span, number)
        out = codec.decode(blob)
        sizes.append(len(blob))
        errors.append(float((out.keys - keys).square().mean() + (out.values - values).square().mean()))
    assert sizes == sorted(sizes) and errors == sorted(errors, reverse=True), (sizes, errors)
    assert sizes[0] < keys.numel() * 2 * 2 / 3  # the coarsest level is under a third of bfloat16


@pytest.mark.parametrize("number", sorted(LEVELS))
def test_entropy_coding_is_lossless(tables: CodecTables, number: int) -> None:
    limit = tables.level(number).limit
    symbols = torch.randint(-limit, limit + 1, (2, LAYERS, HEADS, 37, DIM), dtype=torch.int8)
    coder = tables.coder(number)
    assert torch.equal(coder.decode(coder.encode(symbols), 37), symbols.to(torch.int16))


def test_decoding_returns_exactly_the_quantized_kv(tables: CodecTables) -> None:
    codec = CacheGenCodec(tables)
    keys, values = _kv(33, seed=5)
    x = torch.stack([keys, values])
    out = codec.decode(codec.encode(SpanKV(keys, values, torch.arange(33)), 2))
    lv = tables.level(2)
    q = quantize(x, tables.transform, lv.step, lv.limit)
    expected = dequantize(q, tables.transform, lv.step, x[:, :, :, q.raw].half())  # kept tokens: float16
    torch.testing.assert_close(torch.stack([out.keys, out.values]), expected, rtol=0, atol=0)


def test_kept_tokens_beyond_float16_stay_float32_exact(tables: CodecTables) -> None:
    codec = CacheGenCodec(tables)
    keys, values = _kv(15, seed=6)
    keys[:, :, 0] = 1e6 + 0.25
    out = codec.decode(codec.encode(SpanKV(keys, values, torch.arange(15)), 3))
    assert torch.equal(out.keys[:, :, 0], keys[:, :, 0]) and torch.equal(out.values[:, :, 0], values[:, :, 0])


def test_positions_survive_whether_consecutive_or_not(tables: CodecTables) -> None:
    codec = CacheGenCodec(tables)
    keys, values = _kv(12)
    for positions in (torch.arange(50, 62), torch.tensor([3, 4, 5, 9, 10, 11, 40, 41, 42, 43, 44, 90])):
        assert torch.equal(codec.decode(codec.encode(SpanKV(keys, values, positions), 3)).positions, positions)


def test_tables_round_trip_through_a_file_and_keep_their_digest(tables: CodecTables, tmp_path) -> None:
    path = tmp_path / "tables.safetensors"
    tables.save(path)
    again = CodecTables.load(path)
    assert again.digest == tables.digest and again.levels == tables.levels
    keys, values = _kv(20)
    blob = CacheGenCodec(tables).encode(SpanKV(keys, values, torch.arange(20)), 2)
    assert torch.equal(CacheGenCodec(again).decode(blob).keys, CacheGenCodec(tables).decode(blob).keys)


def test_fitted_levels_keep_their_steps_and_narrow_their_range(tables: CodecTables) -> None:
    for number, lv in tables.levels.items():
        assert lv.step == LEVELS[number].step and 0 < lv.limit <= LEVELS[number].limit
    assert fit_tables([_kv(30)], "m", [Level(7, 0.3)]).levels.keys() == {7}


def test_damaged_table_files_are_refused(tables: CodecTables, tmp_path) -> None:
    path = tmp_path / "tables.safetensors"
    tables.save(path)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # inside the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(CodecCorruptedError, match="digest"):
        CodecTables.load(path)
    (tmp_path / "junk").write_bytes(b"not a table")
    with pytest.raises(CodecCorruptedError, match="cannot be read"):
        CodecTables.load(tmp_path / "junk")


def test_damaged_or_foreign_bytes_are_refused(tables: CodecTables) -> None:
    codec = CacheGenCodec(tables)
    keys, values = _kv(30)
    blob = codec.encode(SpanKV(keys, values, torch.arange(30)), 2)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x01
    with pytest.raises(CodecCorruptedError, match="checksum"):
        codec.decode(bytes(flipped))
    with pytest.raises(CodecCorruptedError, match="checksum"):
        codec.decode(blob[:-100])
    other = fit_tables([_kv(64, 11)], "test-model")
    with pytest.raises(CodecError, match="compressed with CacheGen tables"):
        CacheGenCodec(other).decode(blob)
    wide = fit_tables([(torch.randn(LAYERS, 3, 20, DIM), torch.randn(LAYERS, 3, 20, DIM))], "other-model")
    with pytest.raises(CodecError, match="another model"):
        CacheGenCodec(wide).encode(SpanKV(keys, values, torch.arange(30)), 2)
    with pytest.raises(CodecError, match="no level 9"):
        codec.encode(SpanKV(keys, values, torch.arange(30)), 9)


def test_unknown_levels_are_named() -> None:
    with pytest.raises(UnknownLevelError, match="levels: 1, 2, 3, 4, 5"):
        level(9)


def test_group_size_is_the_papers() -> None:
    assert GROUP_TOKENS == 10


def test_an_allocation_scales_each_layers_keys_and_values_steps(tables: CodecTables, tmp_path) -> None:
    samples = [_kv(64, seed) for seed in range(6)]
    allocation = torch.ones(2, LAYERS)
    allocation[1, 0] = 0.25  # the first layer's values four times finer
    weighted = fit_tables(samples, "test-model", allocation=allocation)
    plain, fine = tables.transform.steps(0.5), weighted.transform.steps(0.5)
    torch.testing.assert_close(fine[1, 0], plain[1, 0] * 0.25)
    torch.testing.assert_close(fine[0], plain[0])
    x = torch.stack(_kv(40, seed=9))

    def error(t: CodecTables) -> float:  # the first layer's values, max abs error
        codec = CacheGenCodec(t)
        out = codec.decode(codec.encode(SpanKV(x[0], x[1], torch.arange(40)), 3))
        return float((out.values - x[1])[0, :, 1:].abs().max())

    assert error(weighted) < 0.5 * error(tables)
    weighted.save(tmp_path / "t.safetensors")
    again = CodecTables.load(tmp_path / "t.safetensors")
    assert again.digest == weighted.digest != tables.digest and torch.equal(again.transform.allocation, allocation)
    with pytest.raises(CodecError, match="allocation"):
        fit_tables(samples, "test-model", allocation=torch.ones(LAYERS))
