"""``bench codec`` on a tiny model: a row per level, smaller and larger in order, zstd measured on the same symbols."""

from __future__ import annotations

import pytest
from conftest import tiny_model

from pc_rag.bench.codec import codec_benchmark, format_rows
from pc_rag.codec import CacheGenCodec, fit_tables
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.rag import RagEngine, RagPrompt


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())


def test_every_level_is_sized_and_timed(engine) -> None:
    texts = [f"{t}\n{x}" for q in sample_questions()[5:8] for t, x in q.passages]
    chunks = engine.encode(texts, "default")
    codec = CacheGenCodec(fit_tables([(c.kv.keys, c.kv.values) for c in chunks], engine.lm.fingerprint()))
    rows = codec_benchmark(engine, codec, questions=1, repeats=1)
    assert [r.codec for r in rows] == [f"cachegen:{n}" for n in sorted(codec.tables.levels)]
    sizes = [r.bytes_per_token for r in rows]
    assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)  # finer levels cost more
    for r in rows:
        assert r.rans_bytes_per_token < r.bytes_per_token  # the header, exact tokens and checksum are extra
        assert r.zstd_bytes_per_token > 0 and r.tokens > r.chunks > 0
        assert min(r.encode_tokens_per_s, r.decode_tokens_per_s, r.decode_tokens_per_s_parallel) > 0
    assert "zstd" in format_rows(rows)
