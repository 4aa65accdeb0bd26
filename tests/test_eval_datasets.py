"""Loading our JSONL and LongBench's, detected per line, with precise errors."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest

from pc_rag.errors import EvalError
from pc_rag.eval.datasets import (
    TUNING_SPLIT,
    Passage,
    in_tuning_split,
    load_datasets,
    load_examples,
    split_longbench_context,
    tuning_split,
)
from pc_rag.eval.longbench import context_text

OURS = {
    "id": "q1",
    "dataset": "hotpotqa",
    "question": "Where?",
    "answers": ["Tulsa"],
    "passages": [{"title": "T1", "text": "Body one.", "is_supporting": True}, {"title": "T2", "text": "Two."}],
}
LONGBENCH = {
    "_id": "lb1",
    "input": "Who?",
    "context": "Passage 1:\nAlpha\nFirst line.\nSecond line.\nPassage 2:\nBeta (film)\nIt is a film.\n",
    "answers": ["Alpha"],
    "length": 12,
    "all_classes": None,
}


def _write(path: Path, *lines: object) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def test_longbench_context_is_split_at_passage_headers() -> None:
    passages = split_longbench_context(LONGBENCH["context"])
    assert passages == [Passage("Alpha", "First line.\nSecond line.", None), Passage("Beta (film)", "It is a film.")]


def test_split_inverts_longbench_rendering() -> None:
    pieces = [("Title one", "Text with\nPassage 3: inside a line."), ("Two", "More.")]
    split = split_longbench_context(context_text(pieces))
    assert [(p.title, p.text) for p in split] == pieces


def test_formats_are_detected_per_line(tmp_path: Path) -> None:
    examples = load_examples(_write(tmp_path / "mixed.jsonl", OURS, "", LONGBENCH))
    ours, lb = examples
    assert (ours.dataset, ours.id, ours.answers) == ("hotpotqa", "q1", ("Tulsa",))
    assert ours.passages[0].is_supporting is True and ours.passages[1].is_supporting is None
    assert (lb.dataset, lb.id, lb.question) == ("mixed", "lb1", "Who?")  # no dataset field: the file stem
    assert [p.title for p in lb.passages] == ["Alpha", "Beta (film)"]
    assert all(p.is_supporting is None for p in lb.passages)


def test_limit_is_per_file(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.jsonl", *({**OURS, "id": f"a{i}"} for i in range(5)))
    b = _write(tmp_path / "b.jsonl", *({**LONGBENCH, "_id": f"b{i}"} for i in range(3)))
    examples = load_datasets([a, b], limit=2)
    assert [e.id for e in examples] == ["a0", "a1", "b0", "b1"]
    assert [e.id for e in load_datasets([a, b], limit=[3, 1])] == ["a0", "a1", "a2", "b0"]


def test_bundled_sample_loads() -> None:
    examples = load_examples(Path(__file__).parents[1] / "pc_rag" / "data" / "hotpotqa_sample.jsonl", limit=3)
    assert len(examples) == 3 and all(e.passages and e.answers for e in examples)


@pytest.mark.parametrize(
    ("lines", "match"),
    [
        ([OURS, "{not json"], r"bad\.jsonl:2: invalid JSON"),
        ([OURS, {"foo": 1}], r"bad\.jsonl:2: unknown format"),
        ([{**OURS, "answers": "Tulsa"}], r"bad\.jsonl:1: 'answers' must be a list"),
        ([{k: v for k, v in OURS.items() if k != "question"}], r"bad\.jsonl:1: missing field\(s\) 'question'"),
        ([{**LONGBENCH, "context": "no headers"}], r"bad\.jsonl:1: .*no 'Passage N:' header"),
        ([OURS, OURS], r"bad\.jsonl:2: id 'q1' repeats"),
        ([[1, 2]], r"bad\.jsonl:1: expected a JSON object"),
    ],
)
def test_bad_lines_name_the_file_and_line(tmp_path: Path, lines: list[object], match: str) -> None:
    with pytest.raises(EvalError, match=match):
        load_examples(_write(tmp_path / "bad.jsonl", *lines))


def test_missing_file_and_bad_limit(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="not found"):
        load_examples(tmp_path / "nope.jsonl")
    with pytest.raises(EvalError, match="--limit"):
        load_examples(_write(tmp_path / "ok.jsonl", OURS), limit=0)


def test_examples_know_their_position_in_their_file(tmp_path: Path) -> None:
    examples = load_examples(_write(tmp_path / "mixed.jsonl", OURS, "", LONGBENCH, {**OURS, "id": "q2"}))
    assert [e.index for e in examples] == [0, 1, 2]  # blank lines are not examples


def test_the_tuning_split_is_hotpotqa_300_to_699(tmp_path: Path) -> None:
    assert dict(TUNING_SPLIT) == {"hotpotqa": range(300, 700)}
    hotpot = load_examples(_write(tmp_path / "h.jsonl", *({**OURS, "id": f"h{i}"} for i in range(702))))
    assert [e.id for e in tuning_split(hotpot)] == [f"h{i}" for i in range(300, 700)]
    other = load_examples(_write(tmp_path / "o.jsonl", *({**OURS, "id": f"o{i}", "dataset": "musique"}
                                                          for i in range(702))))  # fmt: skip
    assert tuning_split(other) == []  # the split names a dataset, not positions in any file
    assert in_tuning_split(hotpot[350]) and not in_tuning_split(replace(hotpot[350], index=None))  # no file


def test_evaluation_skips_the_tuning_split_and_limits_what_remains(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    hotpot = _write(tmp_path / "h.jsonl", *({**OURS, "id": f"h{i}"} for i in range(702)))
    other = _write(tmp_path / "o.jsonl", *({**OURS, "id": f"o{i}", "dataset": "musique"} for i in range(400)))
    with caplog.at_level(logging.WARNING):
        examples = load_datasets([hotpot, other], limit=[301, 350])
    assert [e.id for e in examples] == [*(f"h{i}" for i in range(300)), "h700", *(f"o{i}" for i in range(350))]
    assert "h.jsonl: skipped 400 examples of the tuning split (hotpotqa 300-699)" in caplog.text
    assert len(caplog.records) == 1  # nothing skipped in the other file: nothing said
    caplog.clear()
    assert [e.id for e in load_datasets([hotpot], limit=5)] == [f"h{i}" for i in range(5)]  # before the split
    assert not caplog.records
    everything = load_datasets([hotpot], limit=301, include_tuning_split=True)
    assert [e.id for e in everything] == [f"h{i}" for i in range(301)]
    assert len(load_examples(hotpot)) == 702  # loading a file for tuning keeps every example
