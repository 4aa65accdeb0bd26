"""The CacheGen codec: quantization bounds, lossless entropy coding, self-describing bytes, clear errors."""

from __future__ import annotations

import hashlib

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


@pytest.mark.parametrize("anchored", [False, True])
def test_symbols_beyond_the_range_escape_and_decode_within_half_a_step(tables: CodecTables, anchored: bool) -> None:
    t = tables.transform
    transform = Transform(t.mean, t.basis, t.rms, torch.full_like(t.anchored, anchored))
    x = torch.stack(_kv(30, seed=4))
    x[:, :, :, 11] *= 40  # an anchor
    x[:, :, :, 17] *= 40
    q = quantize(x, transform, 0.5, 20)
    assert q.raw.tolist() == [0] and int(q.symbols.abs().max()) <= 20
    assert q.escapes.index.numel() > 0 and int(q.escapes.remainder.abs().min()) >= 1
    out = dequantize(q, transform, 0.5, x[:, :, :, q.raw])
    error = (transform.forward(out) - transform.forward(x)).abs()
    assert bool((error <= 0.5 * transform.steps(0.5) + 1e-3).all())


def test_tokens_beyond_what_an_escape_holds_are_kept_exactly(tables: CodecTables) -> None:
    x = torch.stack(_kv(30, seed=4))
    x[:, :, :, 17] *= 1e6
    q = quantize(x, tables.transform, 0.5, 20)
    assert q.raw.tolist() == [0, 17]
    torch.testing.assert_close(dequantize(q, tables.transform, 0.5, x[:, :, :, q.raw])[:, :, :, 17], x[:, :, :, 17])


def test_the_codec_carries_escapes(tables: CodecTables) -> None:
    keys, values = _kv(40, seed=8)
    keys[:, :, 23] *= 40
    codec = CacheGenCodec(tables)
    span = SpanKV(keys, values, torch.arange(40))
    q = quantize(torch.stack([keys, values]), tables.transform, tables.level(2).step, tables.level(2).limit)
    assert q.escapes.index.numel() > 0 and q.raw.tolist() == [0]
    out = codec.decode(codec.encode(span, 2))
    raw = torch.stack([keys, values])[:, :, :, q.raw].half().float()  # exact tokens are stored in float16
    expected = dequantize(q, tables.transform, tables.level(2).step, raw)
    torch.testing.assert_close(out.keys, expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.values, expected[1], atol=1e-4, rtol=1e-4)


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


def test_chunks_of_format_1_without_escapes_still_decode(tables: CodecTables) -> None:
    from pc_rag.codec import cachegen

    keys, values = _kv(25, seed=12)
    span = SpanKV(keys, values, torch.arange(3, 28))
    blob = CacheGenCodec(tables).encode(span, 3)
    fields = list(cachegen._HEADERS[2].unpack_from(blob))
    assert fields[11] == 0 and tables.shared is None, "this span needs no escapes and no shared tokens"
    del fields[11]
    fields[1] = 1
    refs = cachegen._HEADERS[2].size + 4 * fields[9]  # format 1 has no references to shared tokens
    body = cachegen._HEADERS[1].pack(*fields) + blob[cachegen._HEADERS[2].size : refs] + blob[refs + fields[9] : -8]
    old = body + hashlib.blake2b(body, digest_size=8).digest()
    out, new = CacheGenCodec(tables).decode(old), CacheGenCodec(tables).decode(blob)
    assert torch.equal(out.keys, new.keys) and torch.equal(out.values, new.values)
    assert torch.equal(out.positions, span.positions)


def test_a_first_token_every_chunk_shares_is_referenced_not_stored(tmp_path) -> None:
    sink = torch.stack(_kv(1, seed=77))[:, :, :, 0]  # [2, L, H, D]: the same first token in every chunk

    def chunk(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = _kv(length, seed)
        keys[:, :, 0], values[:, :, 0] = sink[0], sink[1]
        return keys, values

    shared = fit_tables([chunk(64, seed) for seed in range(6)], "test-model")
    assert shared.shared is not None and torch.equal(shared.shared[0], sink)
    shared.save(tmp_path / "t.safetensors")
    shared = CodecTables.load(tmp_path / "t.safetensors")
    keys, values = chunk(30, seed=40)
    span = SpanKV(keys, values, torch.arange(30))
    plain = fit_tables([chunk(64, seed) for seed in range(6)][:1], "test-model")  # one sample: nothing shared
    assert plain.shared is None
    blob = CacheGenCodec(shared).encode(span, 3)
    assert len(blob) < len(CacheGenCodec(plain).encode(span, 3)) - 2 * LAYERS * HEADS * DIM * 2 + 64
    out = CacheGenCodec(shared).decode(blob)
    assert torch.equal(out.keys[:, :, 0], sink[0]) and torch.equal(out.values[:, :, 0], sink[1])
    other = CacheGenCodec(fit_tables([_kv(64, seed) for seed in range(6)], "test-model"))
    with pytest.raises(CodecError, match="tables"):  # another table's digest: refused before any reference is read
        other.decode(blob)
