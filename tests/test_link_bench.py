"""``bench link`` on a tiny model: every storage measured over the link, the loader's choices reported."""

from __future__ import annotations

import pytest
from conftest import tiny_model

from pc_rag.bench.link import format_rows, link_benchmark
from pc_rag.cli import main
from pc_rag.codec import CacheGenCodec, fit_tables
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.rag import RagEngine, RagPrompt


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())


@pytest.fixture(scope="module")
def codec(engine: RagEngine) -> CacheGenCodec:
    texts = [f"{t}\n{x}" for q in sample_questions()[5:8] for t, x in q.passages]
    chunks = engine.encode(texts, "default")
    return CacheGenCodec(fit_tables([(c.kv.keys, c.kv.values) for c in chunks], engine.lm.fingerprint()))


def test_every_storage_is_timed_over_the_link(engine, codec) -> None:
    slow, fast = 8e6, 1e12  # bits/s
    rows = link_benchmark(engine, codec, [slow, fast], questions=2, ttft_target_s=10.0)
    by = {(r.bandwidth_bits_per_s, r.storage): r for r in rows}
    storages = ["bfloat16", *(f"cachegen:{n}" for n in sorted(codec.tables.levels)), "cachegen:adaptive"]
    assert set(by) == {(b, s) for b in (slow, fast) for s in storages} | {(0.0, "warm")}
    raw = by[slow, "bfloat16"]
    assert raw.load_ms >= 1000 * raw.bytes_per_token * 8 / slow * 100  # >= 100 tokens' bytes through the link
    assert by[slow, "cachegen:1"].bytes_per_token < raw.bytes_per_token / 3
    assert set(by[fast, "cachegen:adaptive"].levels) == {"0"}  # a fast link: bfloat16, no decoding
    assert by[slow, "cachegen:5"].load_ms > by[slow, "cachegen:1"].load_ms
    assert "cachegen:adaptive" in format_rows(rows)


def test_bad_bandwidths_are_refused_before_loading(capsys) -> None:
    assert main(["bench", "link", "--bandwidth", "100X"]) == 2
    assert "--bandwidth takes" in capsys.readouterr().err
