"""Every ``pc-rag`` subcommand runs end to end on a tiny random model saved as a transformers directory
(``--model DIR``), in process, in a few seconds each; output is checked for shape, not for quality."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import tiny_model, tiny_tokenizer

from pc_rag.cli import main

SAMPLE = Path(__file__).parents[1] / "pc_rag" / "data" / "hotpotqa_sample.jsonl"

DOCS = {
    "fuji.txt": "Mount Fuji is the highest mountain in Japan. It is an active volcano near Tokyo.",
    "danube.txt": "The Danube is a long river in Europe. It flows through Vienna into the Black Sea.",
    "paris.txt": "Paris is the capital of France. The Eiffel Tower stands on the Champ de Mars.",
}


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with the tiny model, the documents, and the pc-rag cache (``PC_RAG_CACHE``) of this module."""
    root = tmp_path_factory.mktemp("cli")
    lm = tiny_model("llama", tiny_tokenizer())
    lm.model.save_pretrained(root / "model")
    lm.tokenizer.save_pretrained(root / "model")
    (root / "docs").mkdir()
    for name, text in DOCS.items():
        (root / "docs" / name).write_text(text)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PC_RAG_CACHE", str(root / "cache"))
        yield root


def run(home: Path, capsys: pytest.CaptureFixture[str], *args: str, verbose: bool = False) -> tuple[str, str]:
    """``pc-rag --model <tiny> ARGS``: its stdout and stderr, after checking it exited 0."""
    argv = ["--model", str(home / "model"), *(["--verbose"] if verbose else []), *args]
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


@pytest.fixture(scope="module")
def store(home: Path) -> Path:
    assert main(["--model", str(home / "model"), "index", str(home / "docs"), "--store", str(home / "store")]) == 0
    return home / "store"


def test_index_then_ask_lists_sources_and_shows_no_progress_bars(home, store, capsys) -> None:
    out, err = run(home, capsys, "ask", "Which river flows into the Black Sea?", "--store", str(store), "--k", "2",
                   "--max-new-tokens", "3", "--full")  # fmt: skip
    assert "sources:" in out and "ms cached" in out and "ms full prefill" in out
    assert "Loading weights" not in err and "it/s]" not in err, err
    _, err = run(home, capsys, "ask", "Where is Fuji?", "--store", str(store), "-k", "1", "--max-new-tokens", "1",
                 verbose=True)  # fmt: skip
    assert "Loading weights" in err  # what the check above looks for does show with --verbose


def test_argument_errors_name_the_program_once(store, capsys) -> None:
    for argv, err in [
        (["--nope", "ask", "q", "--store", str(store)], "unrecognized arguments: --nope"),
        (["ask", "q", "--store", str(store), "--k", "0"], "ask: argument -k/--k: must be at least 1, got 0"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert capsys.readouterr().err == f"pc-rag: error: {err} (see --help)\n"


@pytest.mark.parametrize("action", ["verify", "repair", "compact"])
def test_store_maintenance(home, store, capsys, action: str) -> None:
    out, _ = run(home, capsys, "store", action, "--store", str(store))
    assert out.strip()


def test_store_recode(home, store, capsys) -> None:
    record = home / "recode.json"
    run(home, capsys, "store", "recode", "--store", str(store), "--codec", "raw", "--json", str(record))
    assert json.loads(record.read_text())["chunks"] == len(DOCS)


def few_questions(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """``module`` reads two of the bundled sample questions instead of all (seconds, not a minute)."""
    from pc_rag.sample import sample_questions

    two = sample_questions()[:2]
    monkeypatch.setattr(f"{module}.sample_questions", lambda: two)


def test_demo(home, capsys, monkeypatch) -> None:
    few_questions(monkeypatch, "pc_rag.sample")
    out, _ = run(home, capsys, "demo", "--questions", "1")
    assert "building a store" in out and "question" in out


def test_serve_answers_a_rag_request(home, store, capsys, monkeypatch) -> None:
    uvicorn = pytest.importorskip("uvicorn")
    from fastapi.testclient import TestClient

    replies = []

    def one_request(server: object) -> None:  # in place of listening: one request through the app, then stop
        with TestClient(server.config.app) as client:
            replies.append(client.post("/v1/rag", json={"question": "Where is Fuji?", "k": 2, "max_tokens": 2}))

    monkeypatch.setattr(uvicorn.Server, "run", one_request)
    out, _ = run(home, capsys, "serve", "--store", str(store), "--port", "1")
    assert "serving" in out and replies[0].status_code == 200, replies[0].text
    assert len(replies[0].json()["sources"]) == 2


def test_bench_ttft(home, capsys, tmp_path) -> None:
    out, _ = run(home, capsys, "bench", "ttft", "--tokens", "96", "--runs", "1", "--json", str(tmp_path / "t.json"))
    assert "floor ms" in out
    (row,) = json.loads((tmp_path / "t.json").read_text())
    assert row["floor_ms"] > 0 and row["cached_ttft_ms"] > 0


def test_bench_serve(home, capsys) -> None:
    out, _ = run(home, capsys, "bench", "serve", "--concurrency", "2", "--shared-tokens", "64", "--new-tokens", "2")
    assert out.strip()


def test_bench_encode(home, capsys, monkeypatch) -> None:
    few_questions(monkeypatch, "pc_rag.bench.encode")
    out, _ = run(home, capsys, "bench", "encode", "--runs", "1")
    assert out.strip()


def test_bench_memory(home, capsys) -> None:
    out, _ = run(home, capsys, "bench", "memory")
    assert "float32" in out


def test_eval(home, capsys, tmp_path) -> None:
    out, _ = run(home, capsys, "eval", "--dataset", str(SAMPLE), "--limit", "1", "--modes", "full,prefix",
                 "--max-new-tokens", "2", "--json", str(tmp_path / "e.json"))  # fmt: skip
    assert "prefix" in out and (tmp_path / "e.json").is_file()
