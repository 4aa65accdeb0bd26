"""``bench peers --answers`` on a tiny model: whole answers timed with speculation on and off, outputs compared,
llama.cpp reported with its reason when missing, and the gates computed from the rows."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model

from pc_rag.bench import llama_cpp_answers
from pc_rag.bench.answer_rows import MAX_TOKENS
from pc_rag.bench.answer_time import LLAMA_CPP_ROWS, AnswerRow, answer_workload, gates, run_answers, summary
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.rag import RagEngine


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer))


def test_a_workload_holds_its_questions_passages_first_and_about_the_target(engine: RagEngine) -> None:
    question = sample_questions()[1]
    work = answer_workload(engine, question, 600)
    assert 560 <= len(work.ids) <= 620
    first_title = question.passages[0][0]
    assert first_title in engine.lm.tokenizer.decode(list(work.chunks[0].token_ids))
    assert work.documents < len(work.ids)


def test_a_workload_leaves_room_for_the_answer_within_the_models_positions(engine: RagEngine, monkeypatch) -> None:
    monkeypatch.setattr(engine.lm.model.config, "max_position_embeddings", 700)
    for question in sample_questions()[:3]:  # questions longer than the one the passage budget counts
        work = answer_workload(engine, question, 8192)
        assert 600 <= len(work.ids) <= 700 - MAX_TOKENS


def test_every_row_is_timed_speculation_matches_plain_and_llama_cpp_says_why(engine: RagEngine, monkeypatch) -> None:
    monkeypatch.setattr(llama_cpp_answers.importlib.util, "find_spec", lambda name: None)  # not installed
    rows = run_answers(engine, [250], questions=1, runs=1, gguf=None, busy=[0, 1], log=lambda line: None)
    missing = [r for r in rows if r.peer in LLAMA_CPP_ROWS]
    assert len(missing) == 3 and all("not installed" in r.note for r in missing)
    timed = [r for r in rows if r.answer_ms is not None]
    ours = f"pc-rag {engine.default_mode} + speculation"
    beside = {f"{ours} (--threads auto)", f"{ours} (--threads {torch.get_num_threads()})"}  # the busy section
    names = {r.peer for r in timed if r.busy == 0} - beside
    modes = dict.fromkeys((engine.default_mode, "naive"))
    assert names == {f"pc-rag {m}{s}" for m in modes for s in ("", " + speculation")}
    speculative = [r for r in timed if r.peer.endswith("speculation") and r.busy == 0]
    assert len(speculative) == len(modes) and all(r.same_as_plain for r in speculative)
    assert all(r.tokens_per_step == 1 for r in timed if not r.peer.endswith("speculation"))
    section = [(r.busy, r.peer.endswith("(--threads auto)")) for r in rows if r.peer in beside]
    assert section == [(0, False), (0, True), (1, False), (1, True)]
    table = summary(rows)
    assert {line["peer"] for line in table} - names == beside
    checks = {c["name"]: c for c in gates(rows, engine.default_mode)}
    assert checks["greedy output with speculation = plain, share of rows"]["met"]
    busy = next(c for c in checks.values() if c["name"].startswith("answer time with one busy loop / idle"))
    assert "(--threads auto)" in busy["name"] and busy["value"] > 0
    assert any(c["value"] is None and not c["met"] for c in checks.values())  # llama.cpp's gates: no rows


def test_gates_compare_our_answers_with_llama_cpps_on_the_same_questions() -> None:
    def row(peer: str, q: str, ms: float, speed: float, same: bool | None = None) -> AnswerRow:
        return AnswerRow(peer, 1030, q, 100, ms, 20, speed, None, same)

    rows = [
        row("pc-rag fast", "a", 1000, 20), row("pc-rag fast + speculation", "a", 600, 40, True),
        row("pc-rag fast", "b", 1000, 20), row("pc-rag fast + speculation", "b", 900, 25, True),
        row(LLAMA_CPP_ROWS[1], "a", 700, 30), row(LLAMA_CPP_ROWS[1], "b", 800, 30),
    ]  # fmt: skip
    checks = {c["name"]: c for c in gates(rows, "fast")}
    answer = checks["answer time, pc-rag fast + speculation / llama.cpp warm, 1024 tokens"]
    assert answer["value"] == pytest.approx((600 / 700 + 900 / 800) / 2) and answer["met"]
    decode = checks["decode tokens/s, pc-rag fast + speculation / llama.cpp plain decode, 1024 tokens"]
    assert decode["value"] == pytest.approx((40 / 30 + 25 / 30) / 2) and decode["met"]
    gain = checks["decode tokens/s, speculation / plain decode (median over questions)"]
    assert gain["value"] == pytest.approx((2 + 1.25) / 2) and gain["met"]


def test_llama_cpp_runs_in_a_process_of_its_own_and_a_failure_there_is_three_rows_that_say_so(tmp_path) -> None:
    job = {"gguf": str(tmp_path / "missing.gguf"), "threads": 1, "context": 512, "runs": 1, "stop_ids": [0],
           "works": [{"question": "q", "ids": [1, 2, 3], "documents": 2}]}  # fmt: skip
    rows = llama_cpp_answers.llama_cpp_rows(job)
    assert [r.peer for r in rows] == list(LLAMA_CPP_ROWS)
    assert all("llama.cpp process failed" in r.note and r.answer_ms is None for r in rows)
