"""Bad input to every store verb: a one-line error naming the problem, exit code 2, nothing written.

All of these are refused before the model loads (the test makes loading fail loudly).
"""

from __future__ import annotations

import pytest

from pc_rag import model
from pc_rag.cli import main


@pytest.fixture
def files(tmp_path, monkeypatch):
    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(model, "load_model", no_model)
    (tmp_path / "ok.txt").write_text("Mount Fuji is the highest mountain in Japan.")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "binary.txt").write_bytes(b"\x00\x01\x02text")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    (tmp_path / "bad-meta.jsonl").write_text('{"text": "fine", "metadata": [1, 2]}\n')
    (tmp_path / "dup.jsonl").write_text(
        '{"id": "a", "text": "one"}\n{"id": "b", "text": "two"}\n{"id": "a", "text": "1"}\n'
    )
    (tmp_path / "a-file").write_text("not a store")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("the user's own file")
    return tmp_path


CASES = [
    (["index", "{tmp}/missing.txt", "--store", "{tmp}/s"], "no such file or directory: {tmp}/missing.txt"),
    (["index", "{tmp}/empty.txt", "--store", "{tmp}/s"], "empty.txt is empty"),
    (["index", "{tmp}/binary.txt", "--store", "{tmp}/s"], "binary.txt looks binary"),
    (["index", "{tmp}/latin1.txt", "--store", "{tmp}/s"], "latin1.txt is not UTF-8"),
    (["index", "{tmp}/broken.jsonl", "--store", "{tmp}/s"], "broken.jsonl:2: invalid JSON"),
    (["index", "{tmp}/bad-meta.jsonl", "--store", "{tmp}/s"], "bad-meta.jsonl:1: 'metadata' must be an object"),
    (["index", "{tmp}/dup.jsonl", "--store", "{tmp}/s"], "dup.jsonl:3: id 'a' is also the id of {tmp}/dup.jsonl:1"),
    (["index", "{tmp}/ok.txt", "--store", "{tmp}/s", "--chunk-tokens", "0"], "--chunk-tokens: must be at least 1"),
    (["index", "{tmp}/ok.txt", "--store", "{tmp}/s", "--chunk-tokens", "x"], "--chunk-tokens: not an integer"),
    (["index", "{tmp}/ok.txt", "--store", "{tmp}/s", "--overlap", "-1"], "--overlap: must be at least 0"),
    (["index", "{tmp}/ok.txt", "--store", "{tmp}/s", "--chunk-tokens", "8", "--overlap", "8"], "smaller than"),
    (["index", "{tmp}/ok.txt", "--store", "{tmp}/a-file"], "is a file"),
    (["index", "{tmp}/ok.txt", "--store", "{tmp}/mine"], "non-empty directory that holds no store"),
    (["index", "{tmp}/ok.txt", "--store", "{tmp}/s", "--limit", "0"], "--limit: must be at least 1"),
    (["ask", "q", "--store", "{tmp}/s"], "not a pc-rag store"),
    (["ask", "q", "--store", "{tmp}/a-file"], "is a file"),
    (["ask", "  ", "--store", "{tmp}/mine"], "not a pc-rag store"),
    (["ask", "q", "--store", "{tmp}/s", "-k", "0"], "-k: must be at least 1"),
    (["ask", "q", "--store", "{tmp}/s", "--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (["store", "repair", "--store", "{tmp}/s"], "not a pc-rag store"),
    (["store", "fix", "--store", "{tmp}/s"], "invalid choice: 'fix'"),
    (["index", "--store", "{tmp}/s"], "the following arguments are required: paths"),
    (["index", "{tmp}/ok.txt", "--store", "{tmp}/s", "--codec", "zip"], "--codec takes raw, cachegen"),
    (["store", "recode", "--store", "{tmp}/s"], "`store recode` needs it"),
    (["store", "compact", "--store", "{tmp}/s", "--codec", "cachegen"], "--codec goes with `store recode`"),
    (["store", "verify", "--store", "{tmp}/s", "--json", "{tmp}/r.json"], "--json goes with `store recode`"),
    (["store", "recode", "--store", "{tmp}/s", "--codec", "cachegen:x"], "--codec takes raw, cachegen"),
    (["index", "{tmp}/ok.txt", "--store", "{tmp}/s", "--ray"], "--ray writes modules where every actor reaches"),
    (["index", "{tmp}/ok.txt", "--store", "{tmp}/s", "--modules", "ftp://x"], "module store address 'ftp://x'"),
    (["ask", "q", "--store", "{tmp}/s", "--modules", "http://h"], "use redis://host:port/db"),
]


@pytest.mark.parametrize(("args", "message"), CASES, ids=[" ".join(a[:2]) + f"-{i}" for i, (a, _) in enumerate(CASES)])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(files, capsys, args: list[str], message: str) -> None:
    before = sorted(p.relative_to(files) for p in files.rglob("*"))
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main([a.replace("{tmp}", str(files)) for a in args]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pc-rag: error: "), err
    assert message.replace("{tmp}", str(files)) in err
    assert sorted(p.relative_to(files) for p in files.rglob("*")) == before
