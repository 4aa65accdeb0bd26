"""Eval modes over CacheGen-compressed chunks: compared with the same mode uncompressed, resumable, refused
without a codec."""

from __future__ import annotations

import pytest
from conftest import tiny_model

from pc_rag.codec import CacheGenCodec, fit_tables
from pc_rag.errors import EvalError
from pc_rag.eval import aggregate, format_table, run_eval
from pc_rag.eval.codec_modes import split_codec_mode, with_codec
from pc_rag.eval.datasets import Example, Passage
from pc_rag.rag import RagEngine, RagPrompt

WORDS = ["river", "tower", "mountain", "city", "bridge", "forest", "lake", "castle", "valley", "island"]


def _examples(n: int) -> list[Example]:
    return [
        Example("toy", f"q{i}", f"Which {WORDS[i]} is it?", (WORDS[i],),
                tuple(Passage(f"T{j}", " ".join(WORDS[(i + j + k) % 10] for k in range(12))) for j in range(3)), i)
        for i in range(n)
    ]  # fmt: skip


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())


@pytest.fixture(scope="module")
def codec(engine: RagEngine) -> CacheGenCodec:
    texts = [engine.passage_text(j + 1, p.title, p.text) for e in _examples(6) for j, p in enumerate(e.passages)]
    chunks = engine.encode(texts, "naive") + engine.encode(texts, "default")
    return CacheGenCodec(fit_tables([(c.kv.keys, c.kv.values) for c in chunks], engine.lm.fingerprint()))


def test_compressed_modes_are_compared_with_their_uncompressed_twin(engine, codec) -> None:
    modes = ["naive", "naive@cachegen:1", "naive@cachegen:5"]
    records = run_eval(engine, _examples(4), modes, max_new_tokens=4, progress=False, codec=codec)
    by_mode = {m: [r for r in records if r.mode == m] for m in modes}
    assert all(r.codec_kl is None for r in by_mode["naive"])
    coarse, fine = (sum(r.codec_kl for r in by_mode[m]) for m in modes[1:])
    assert 0 <= fine < coarse, (fine, coarse)
    rows = {r.mode: r for r in aggregate(records, ["full", *modes]) if r.dataset == "all"}
    assert rows["naive@cachegen:5"].codec_f1_delta is not None and rows["naive"].codec_kl is None
    assert "codecKL" in format_table(list(rows.values()))


def test_a_resumed_run_compares_with_the_uncompressed_mode_done_before(engine, codec, tmp_path) -> None:
    state = tmp_path / "state.jsonl"
    run_eval(engine, _examples(2), ["naive"], state_path=state, max_new_tokens=3, progress=False)
    records = run_eval(engine, _examples(2), ["naive", "naive@cachegen:3"], state_path=state, max_new_tokens=3,
                       progress=False, codec=codec)  # fmt: skip
    assert all(r.codec_kl is not None and r.codec_kl >= 0 for r in records if r.mode == "naive@cachegen:3")


def test_compressed_modes_need_a_codec_and_a_numeric_level(engine) -> None:
    with pytest.raises(EvalError, match="need a codec"):
        run_eval(engine, _examples(1), ["naive@cachegen:2"], progress=False)
    with pytest.raises(EvalError, match="must be a number"):
        split_codec_mode("naive@cachegen:x")
    assert with_codec(["full", "default"], [4]) == ["full", "default", "default@cachegen:4"]
    assert with_codec(["naive", "full"], [2, 3]) == ["naive", "naive@cachegen:2", "naive@cachegen:3", "full"]


def test_compressed_chunks_drop_the_store_source(engine, codec) -> None:
    """Under its source the engine shares a store chunk's KV as stored: a compressed copy must not reuse it."""
    from dataclasses import replace

    from pc_rag.eval.codec_modes import compressed

    chunks = [replace(c, source="store/1@v1") for c in engine.encode(["river tower city"], "prefix")]
    assert [c.source for c in compressed(chunks, codec, 3)] == [None]
