"""``pc-rag index`` and ``ask`` end to end with SmolLM2: answers with sources, and bad input exits non-zero."""

from __future__ import annotations

import json

import pytest

from pc_rag.cli import main
from pc_rag.store.manifest import MANIFEST_NAME

pytestmark = pytest.mark.real_model


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "eiffel.txt").write_text("The Eiffel Tower in Paris was designed by Gustave Eiffel's company.")
    (tmp_path / "docs" / "fuji.md").write_text("Mount Fuji is the highest mountain in Japan.")
    return tmp_path


def test_index_then_ask(corpus, capsys) -> None:
    store = corpus / "store"
    assert main(["index", str(corpus / "docs"), "--store", str(store)]) == 0
    assert "indexed 2 documents" in capsys.readouterr().out
    assert (
        main(["ask", "--store", str(store), "-k", "2", "--max-new-tokens", "8", "--full", "Who designed the tower?"])
        == 0
    )
    out = capsys.readouterr().out
    assert "sources:" in out and "eiffel.txt" in out and "ms cached" in out and "ms full prefill" in out


def test_recode_reports_what_it_did_as_json(corpus, capsys) -> None:
    store = corpus / "store"
    assert main(["index", str(corpus / "docs"), "--store", str(store)]) == 0
    out = corpus / "recode.json"
    assert main(["store", "recode", "--store", str(store), "--codec", "cachegen:2", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["codec"] == "cachegen:2" and record["chunks"] == 2 and record["tokens"] > 10
    # a tiny store grows: the model's codec tables (tens of MB) are copied into it
    assert record["bytes_per_token"] == record["bytes_after"] / record["tokens"] and record["seconds"] > 0
    assert "B/token" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ask", "--store", "{tmp}/nowhere", "q"], "not a pc-rag store"),
        (["ask", "--store", "{tmp}/store", "-k", "2", "word " * 9000], "exceeds"),
        (["index", "{tmp}/binary.txt", "--store", "{tmp}/other"], "looks binary"),
    ],
)
def test_bad_input_exits_non_zero(corpus, capsys, args: list[str], message: str) -> None:
    assert main(["index", str(corpus / "docs"), "--store", str(corpus / "store")]) == 0
    (corpus / "binary.txt").write_bytes(b"\x00\x00\x00")
    capsys.readouterr()
    assert main([a.replace("{tmp}", str(corpus)) for a in args]) == 2
    assert message in capsys.readouterr().err
    assert not (corpus / "other" / MANIFEST_NAME).exists()  # nothing written half-way


def test_ask_reads_a_store_smaller_than_k_whole(corpus, capsys) -> None:
    """The README's `ask ... -k 5` on a store of two chunks answers from both, with a note (it was an error)."""
    assert main(["index", str(corpus / "docs"), "--store", str(corpus / "store")]) == 0
    capsys.readouterr()
    assert main(["ask", "--store", str(corpus / "store"), "-k", "9", "--max-new-tokens", "4", "q"]) == 0
    out, err = capsys.readouterr()
    assert "holds 2 chunks, fewer than k=9: all of them are read" in err
    assert out.count("\n  [") == 2  # both chunks listed as sources
