"""Eval modes over chunks stored in another KV dtype (``<mode>@bfloat16``): the engine reads the KV rounded to
that dtype and back, the rows compare it with the mode on the chunks as encoded, and the CLI adds the twins."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_model
from test_eval_codec import _examples

from pc_rag import cli
from pc_rag.errors import EvalError
from pc_rag.eval import aggregate, run_eval
from pc_rag.eval.codec_modes import stored, with_kv_dtypes
from pc_rag.rag import RagEngine, RagPrompt


class Spy:
    """A ``RagEngine`` that remembers the chunks of each answer, in order."""

    def __init__(self, engine: RagEngine) -> None:
        self.engine, self.read = engine, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def answer(self, chunks: list[Any], question: str, mode: str, **kwargs: Any) -> Any:
        self.read.append(chunks)
        return self.engine.answer(chunks, question, mode, **kwargs)


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_dtype_twin_reads_the_kv_rounded_to_that_dtype(engine: RagEngine, dtype: str) -> None:
    spy = Spy(engine)
    records = run_eval(spy, _examples(2), ["prefix", f"prefix@{dtype}"], max_new_tokens=3, progress=False)
    assert engine.kv_dtype == torch.float32 and len(spy.read) == 2 * 2  # per example: prefix, then its twin
    storage = getattr(torch, dtype)
    for plain, twin in zip(spy.read[::2], spy.read[1::2], strict=True):
        for a, b in zip(plain, twin, strict=True):
            assert a.token_ids == b.token_ids and b.source is None  # never shared with the KV as encoded
            for encoded, read in ((a.kv.keys, b.kv.keys), (a.kv.values, b.kv.values)):
                assert read.dtype == torch.float32
                assert torch.equal(read, encoded.to(storage).float())  # stored in dtype, read back as float32
                assert not torch.equal(read, encoded)  # the float32 KV really was rounded
    twins = [r for r in records if r.mode == f"prefix@{dtype}"]
    assert len(twins) == 2 and all(r.codec_kl is not None and r.codec_kl >= 0 for r in twins)
    rows = {r.mode: r for r in aggregate(records) if r.dataset == "all"}
    assert rows[f"prefix@{dtype}"].codec_f1_delta is not None and rows["prefix"].codec_kl is None


def test_stored_twins_drop_the_chunk_source(engine: RagEngine) -> None:
    """A store's chunk has a source, under which the engine shares its KV as stored with later requests at the
    same positions: a twin keeping it would decode from the float32 copy of the mode that ran before it."""
    from dataclasses import replace

    chunks = [replace(c, source="store/1@v1") for c in engine.encode(["river tower city"], "prefix")]
    assert [c.source for c in stored(chunks, "prefix", None)] == ["store/1@v1"]
    assert [c.source for c in stored(chunks, "prefix@bfloat16", None)] == [None]


def test_dtype_twins_are_named_after_known_storage_dtypes(engine: RagEngine) -> None:
    assert with_kv_dtypes(["full", "fast", "fast@cachegen:2"], ["bfloat16"]) == [
        "full", "fast", "fast@bfloat16", "fast@cachegen:2"
    ]  # fmt: skip
    with pytest.raises(EvalError, match=r"unknown KV storage dtype.*'int8'; known: float32, bfloat16, float16"):
        with_kv_dtypes(["fast"], ["int8"])
    with pytest.raises(EvalError, match="after '@' comes cachegen:<level> or a KV dtype"):
        run_eval(engine, _examples(1), ["prefix@int8"], progress=False)


def test_eval_kv_dtype_adds_twin_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer) -> None:
    monkeypatch.setattr("pc_rag.model.load_model", lambda *a, **k: tiny_model("llama", tokenizer))
    line = {"id": "q1", "question": "Q: Tulsa", "answers": ["Tulsa"], "passages": [{"title": "T", "text": "Tulsa."}]}
    data, out = tmp_path / "qa.jsonl", tmp_path / "r.json"
    data.write_text(json.dumps(line) + "\n")
    argv = ["eval", "--dataset", str(data), "--modes", "naive", "--kv-dtype", "bfloat16", "--max-new-tokens", "2"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    rows = {r["mode"]: r for r in written["results"] if r["dataset"] == "all"}
    assert set(rows) == {"naive", "naive@bfloat16"} and rows["naive@bfloat16"]["codec_kl"] >= 0
    assert written["config"]["kv_dtypes"] == ["bfloat16"]
    assert cli.main([*argv[:-3], "int8"]) == 2  # refused before the model runs
