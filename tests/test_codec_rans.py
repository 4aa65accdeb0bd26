"""The rANS coder: lossless for any table and length, and damaged words are detected, never read past."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pc_rag.codec import rans


@st.composite
def _tables_and_symbols(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    lanes = draw(st.integers(1, 5))
    width = draw(st.integers(1, 255))
    length = draw(st.integers(0, 13))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    skew = draw(st.sampled_from([0.1, 1.0, 30.0]))
    counts = (np.minimum(rng.pareto(1.0 / skew, (lanes, width)), 1e12) * 1000).astype(np.int64) + 1
    symbols = np.stack([rng.integers(0, width, length) for _ in range(lanes)]).astype(np.int32)
    return counts, symbols


@settings(max_examples=200, deadline=None)
@given(_tables_and_symbols())
def test_any_symbols_round_trip_under_any_table(case: tuple[np.ndarray, np.ndarray]) -> None:
    counts, symbols = case
    freq = rans.quantize_probabilities(counts)
    assert (freq.sum(axis=1) == 1 << rans.PROB_BITS).all() and (freq >= 1).all()
    freq, cum, lut = rans.decoding_tables(freq)
    words = rans.encode(symbols, freq, cum)
    out, used = _decode(words, symbols.shape, freq, cum, lut)
    assert used == len(words)
    np.testing.assert_array_equal(out, symbols)
    lanes, length = symbols.shape
    scale = np.linspace(0.5, 2.0, lanes, dtype=np.float32)
    spread = np.full((lanes, 2 * length + 1), np.nan, np.float32)  # every other column, the rest untouched
    used = rans.decode(words, freq, cum, lut, 7, scale, np.arange(1, 2 * length + 1, 2), spread)
    assert used == len(words)
    np.testing.assert_array_equal(spread[:, 1::2], (symbols - 7) * scale[:, None])
    assert np.isnan(spread[:, ::2]).all()


def test_the_rate_is_close_to_the_entropy() -> None:
    rng = np.random.default_rng(0)
    p = np.exp(-0.5 * ((np.arange(41) - 20) / 3.0) ** 2)
    p /= p.sum()
    symbols = rng.choice(41, size=(20, 5000), p=p).astype(np.int32)
    freq, cum, _ = rans.decoding_tables(rans.quantize_probabilities(np.tile((p * 1e6).astype(np.int64) + 1, (20, 1))))
    bits = rans.encode(symbols, freq, cum).nbytes * 8 / symbols.size
    entropy = float(-(p * np.log2(p)).sum())
    assert entropy <= bits < entropy * 1.03, (bits, entropy)


@pytest.mark.parametrize("damage", ["truncate", "flip", "extend"])
def test_damaged_words_are_reported_not_read_past(damage: str) -> None:
    rng = np.random.default_rng(1)
    counts = rng.integers(1, 100, (3, 17))
    symbols = rng.integers(0, 17, (3, 50)).astype(np.int32)
    freq, cum, lut = rans.decoding_tables(rans.quantize_probabilities(counts))
    words = rans.encode(symbols, freq, cum)
    if damage == "truncate":
        words = words[: len(words) // 2]
    elif damage == "flip":
        words = words.copy()
        words[len(words) // 2] ^= 0x5A5A
    else:
        words = np.concatenate([words, words[:3]])
    out, used = _decode(words, (3, 50), freq, cum, lut)
    assert used != len(words) or not np.array_equal(out, symbols)
    if damage != "flip":
        assert used == -1 or used != len(words)


def test_tables_it_cannot_hold_are_refused() -> None:
    with pytest.raises(ValueError, match="at most 256"):
        rans.quantize_probabilities(np.ones((1, 300), dtype=np.int64))
    with pytest.raises(ValueError, match="positive counts"):
        rans.quantize_probabilities(np.array([[3, 0, 1]]))
    with pytest.raises(ValueError, match="sum to 4096"):
        rans.decoding_tables(np.array([[3, 5, 1]]))


def _decode(
    words: np.ndarray, shape: tuple[int, int], freq: np.ndarray, cum: np.ndarray, lut: np.ndarray
) -> tuple[np.ndarray, int]:
    """The symbols [lanes, length] and the words read (-1: damaged), with no offset or scale."""
    out = np.zeros(shape, np.float32)
    used = rans.decode(words, freq, cum, lut, 0, np.ones(shape[0], np.float32), np.arange(shape[1]), out)
    return out, used
