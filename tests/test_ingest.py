"""Reading documents to index: text, markdown, JSONL of texts or of multi-doc QA examples; bad files refused."""

from __future__ import annotations

import json
import re

import pytest

from pc_rag.errors import StoreError
from pc_rag.store.ingest import read_documents


def test_reads_text_markdown_and_jsonl(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("Alpha text.")
    (tmp_path / "b.md").write_text("# Beta\n\nBody.")
    rows = [{"text": "Gamma.", "id": "g", "metadata": {"k": 1}}, {"passages": [{"title": "T", "text": "Delta."}] * 2}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    docs = read_documents([tmp_path])
    assert [d.text for d in docs] == ["Alpha text.", "# Beta\n\nBody.", "Gamma.", "T\nDelta."]  # duplicates merged
    assert docs[2].id == "g" and docs[2].metadata["k"] == 1 and docs[3].metadata["title"] == "T"


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bin.txt", b"\x00\x01binary", "looks binary"),
        ("latin.txt", "caf\xe9".encode("latin-1"), "not UTF-8"),
        ("empty.txt", b"  \n", "empty"),
        ("bad.jsonl", b'{"text": "ok"}\n{broken\n', "bad.jsonl:2: invalid JSON"),
        ("shape.jsonl", b'{"title": "no text"}\n', "shape.jsonl:1: expected"),
    ],
)
def test_bad_files_are_refused_with_their_name(tmp_path, name: str, content: bytes, message: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(StoreError, match=message):
        read_documents([tmp_path / name])


def test_missing_path(tmp_path) -> None:
    with pytest.raises(StoreError, match="no such file"):
        read_documents([tmp_path / "missing.txt"])


def test_two_rows_with_one_id_are_refused_naming_both_lines_unless_identical(tmp_path) -> None:
    rows = [{"id": "a", "text": "One."}, {"id": "b", "text": "Two."}, {"id": "a", "text": "One, edited."}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(StoreError, match=re.escape(f"c.jsonl:3: id 'a' is also the id of {tmp_path}/c.jsonl:1")):
        read_documents([tmp_path / "c.jsonl"])
    rows = [{"id": "a", "text": "One.", "k": 1}, {"id": "b", "text": "Two."}, {"id": "a", "text": "One.", "k": 1}]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert [d.id for d in read_documents([tmp_path / "c.jsonl"])] == ["a", "b"]  # identical rows: read once
    rows[2]["k"] = 2  # same text, other metadata: one of them would be lost
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    with pytest.raises(StoreError, match=r"c\.jsonl:3: id 'a'"):
        read_documents([tmp_path / "c.jsonl"])


def test_an_empty_file_is_skipped_with_a_warning_naming_it(tmp_path, caplog) -> None:
    (tmp_path / "a.txt").write_text("Alpha text.")
    (tmp_path / "empty.md").write_text("  \n")
    (tmp_path / "none.jsonl").write_text("")
    with caplog.at_level("WARNING"):
        docs = read_documents([tmp_path, tmp_path / "empty.md"])  # in the folder, and named explicitly
    assert [d.text for d in docs] == ["Alpha text."]
    assert f"skipping {tmp_path / 'empty.md'}: it is empty" in caplog.text and "none.jsonl" in caplog.text
    with pytest.raises(StoreError, match=r"empty\.md is empty"):  # nothing else to index: an error
        read_documents([tmp_path / "empty.md"])
