"""``pc-rag eval``: user errors exit with code 2 before any model is loaded; a run writes JSON, plot and state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_model

from pc_rag import cli

GOOD = {"id": "q1", "question": "Q: Tulsa", "answers": ["Tulsa"], "passages": [{"title": "T", "text": "Tulsa."}]}


@pytest.fixture(autouse=True)
def no_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr("pc_rag.model.load_model", refuse)


def _data(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("pc-rag: error: ")
    return err


def test_missing_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "dataset file not found" in _error(capsys, ["eval", "--dataset", str(tmp_path / "none.jsonl")])


def test_bad_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _data(tmp_path, json.dumps(GOOD), '{"id": ')
    assert "qa.jsonl:2: invalid JSON" in _error(capsys, ["eval", "--dataset", path])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--limit", "0"], "--limit must be >= 1"),
        (["--limit", "2,x"], "--limit takes N or N1,N2"),
        (["--limit", "2,3"], "2 limits for 1 dataset files"),
        (["--setting", "closed,web"], "--setting takes closed, open"),
        (["-k", "0"], "-k must be >= 1"),
        (["--order", "best-last"], "--order lays out retrieved chunks: it needs --setting open"),
        (["--setting", "open", "--order", "best-last,worst"], "--order takes best-first, best-last, lost-in-the"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["--modes", "full,turbo"], "unknown mode(s) 'turbo'; known modes: full, "),
        (["--json", "/nonexistent-dir/out.json"], "output directory does not exist"),
        (["--codec", "cachegen:2,9"], "CacheGen level 9 is not defined"),
        (["--codec", "zstd"], "--codec takes raw, cachegen"),
    ],
)
def test_argument_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    err = _error(capsys, ["eval", "--dataset", _data(tmp_path, json.dumps(GOOD)), *extra])
    assert message in err


def test_eval_writes_json_plot_and_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tokenizer
) -> None:
    """A tiny real engine behind the CLI: every mode answered, rows per dataset and mode, state resumable."""
    monkeypatch.setattr("pc_rag.model.load_model", lambda *a, **k: tiny_model("llama", tokenizer))
    lines = [json.dumps({**GOOD, "id": f"q{i}", "question": f"Q: answer {i}"}) for i in range(3)]
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["eval", "--dataset", _data(tmp_path, *lines), "--modes", "naive,default", "--limit", "2"]
    assert cli.main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["dataset"], r["mode"], r["n"]) for r in rows} == {
        (d, m, 2) for d in ("qa", "all") for m in ("naive", "default")
    }  # full is computed for agreement but not listed, so not reported
    assert png.read_bytes()[:4] == b"\x89PNG"
    state = tmp_path / "r.json.partial.jsonl"
    assert len(state.read_text().splitlines()) == 2 * 3
    assert "naive" in capsys.readouterr().out


def test_eval_skips_the_tuning_split_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tokenizer
) -> None:
    from pc_rag.eval import contexts

    monkeypatch.setattr("pc_rag.model.load_model", lambda *a, **k: tiny_model("llama", tokenizer))
    monkeypatch.setattr("pc_rag.eval.datasets.TUNING_SPLIT", {"qa": range(1, 3)})  # a small split for the test
    pooled: list[list[str]] = []

    class Open(contexts.ClosedContexts):  # records what open retrieval would pool
        setting = "open"

        def __init__(self, engine, examples, k, directory) -> None:
            super().__init__(engine)
            pooled.append([e.id for e in examples])

        def in_order(self, order: str) -> Open:
            return self

    monkeypatch.setattr(contexts, "OpenContexts", Open)
    lines = [json.dumps({**GOOD, "id": f"q{i}", "question": f"Q: answer {i}"}) for i in range(5)]
    argv = ["eval", "--dataset", _data(tmp_path, *lines), "--modes", "naive", "--setting", "open"]
    out = tmp_path / "r.json"
    assert cli.main([*argv, "--limit", "2", "--json", str(out)]) == 0
    assert {r["n"] for r in json.loads(out.read_text())["results"]} == {2}  # q0 and q3: the limit counts after
    assert pooled == [["q0", "q3"]] and "skipped 2 examples of the tuning split" in caplog.text
    assert json.loads(out.read_text())["config"]["include_tuning_split"] is False
    caplog.clear()
    assert cli.main([*argv, "--include-tuning-split", "--state", str(tmp_path / "s.jsonl")]) == 0
    assert pooled[-1] == [f"q{i}" for i in range(5)] and "tuning split" not in caplog.text


def test_eval_lays_out_retrieved_chunks_in_each_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tokenizer
) -> None:
    """A tiny real engine: each order is its own setting, answered from its layout of the same retrieved chunks."""
    from conftest import tiny_model
    from test_eval_open import EXAMPLES, FACTS, embedder

    from pc_rag.eval import contexts
    from pc_rag.rag import RagEngine

    monkeypatch.setattr("pc_rag.model.load_model", lambda *a, **k: tiny_model("llama", tokenizer))
    real_open = contexts.OpenContexts
    monkeypatch.setattr(contexts, "OpenContexts", lambda *a, **k: real_open(*a, **k, embedder=embedder()))
    layouts: list[list[str]] = []
    real_full = RagEngine.answer_full

    def answer_full(self, chunks, question, **kwargs):
        layouts.append([c.text.split("\n")[0] for c in chunks])
        return real_full(self, chunks, question, **kwargs)

    monkeypatch.setattr(RagEngine, "answer_full", answer_full)
    passages = [{"title": t, "text": x} for t, x in FACTS.items()]
    lines = [json.dumps({"id": e.id, "question": e.question, "answers": list(e.answers), "passages": passages})
             for e in EXAMPLES]  # fmt: skip
    out, stores = tmp_path / "r.json", tmp_path / "stores"
    argv = ["eval", "--dataset", _data(tmp_path, *lines), "--setting", "open", "-k", "3", "--modes", "prefix"]
    assert cli.main([*argv, "--order", "best-first,best-last", "--store-dir", str(stores), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["orders"] == ["best-first", "best-last"]
    assert {(r["setting"], r["dataset"]) for r in result["results"]} == {
        (s, d) for s in ("open", "open:best-last") for d in ("qa", "all")
    }
    ranked, reversed_ = layouts[: len(EXAMPLES)], layouts[len(EXAMPLES) :]
    assert ranked[0][0] == "Danube" and reversed_ == [layout[::-1] for layout in ranked]
    assert len(list(stores.iterdir())) == 1  # the orders share the pooled store
