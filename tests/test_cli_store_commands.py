"""``pc-rag index``, ``ask`` and ``store`` on a tiny model: what they report, and what they say to do next.

The model and the embedder are the tests' tiny ones (``load_model`` and the default embedder are replaced).
"""

from __future__ import annotations

import json
import logging
import re

import pytest
from conftest import tiny_model
from test_document_store import embedder
from test_store_repair import flip_bytes, flip_header_byte

from pc_rag import model
from pc_rag.cli import main
from pc_rag.cli.store_commands import engine_for
from pc_rag.store import document_store
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.manifest import MANIFEST_NAME, Manifest


def cli_home(tmp_path, monkeypatch, lm):
    """``tmp_path`` with two documents in ``docs/``, the CLI loading ``lm`` and the tests' tiny embedder."""
    monkeypatch.setattr(model, "load_model", lambda *args, **kwargs: lm)
    monkeypatch.setattr(document_store, "SentenceTransformerEmbedder", embedder)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "eiffel.txt").write_text("The Eiffel Tower in Paris was designed by Gustave Eiffel's company.")
    (tmp_path / "docs" / "fuji.md").write_text("Mount Fuji is the highest mountain in Japan. It is a volcano.")
    return tmp_path


@pytest.fixture
def corpus(tmp_path, monkeypatch, tokenizer):
    return cli_home(tmp_path, monkeypatch, tiny_model("llama", tokenizer))


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def storage(store) -> str:
    identity = Manifest.load(store / MANIFEST_NAME).identity
    assert identity is not None
    return identity.model_dtype.split("/")[-1]


def test_index_stores_bfloat16_kv_and_reports_the_size_on_disk(corpus, capsys) -> None:
    code, out, _ = run(capsys, "index", corpus / "docs", "--store", corpus / "s")
    assert code == 0 and storage(corpus / "s") == "bfloat16"
    assert re.search(r"^store: 2 documents, \d+ chunks, [\d.]+ MiB on disk$", out, re.MULTILINE), out
    code, out, _ = run(capsys, "ask", "--store", corpus / "s", "-k", "1", "--max-new-tokens", "2", "Who designed it?")
    assert code == 0 and "sources:" in out


def test_a_float32_store_still_loads_grows_and_answers(corpus, capsys) -> None:
    assert run(capsys, "index", corpus / "docs" / "fuji.md", "--store", corpus / "s", "--kv-dtype", "float32")[0] == 0
    code, out, err = run(capsys, "index", corpus / "docs", "--store", corpus / "s")  # no --kv-dtype: the store's
    assert code == 0 and storage(corpus / "s") == "float32" and "ignored" not in err
    assert "store: 2 documents" in out
    code, out, _ = run(capsys, "ask", "--store", corpus / "s", "-k", "2", "--max-new-tokens", "2", "Which mountain?")
    assert code == 0 and "fuji.md" in out


def test_ask_before_the_first_commit_says_the_store_has_no_documents_yet(corpus, capsys, tokenizer) -> None:
    lm = model.load_model()
    DocumentStore.create(corpus / "s", engine_for(lm), embedder=embedder()).close()  # as a first build begins
    code, _, err = run(capsys, "ask", "--store", corpus / "s", "Which mountain?")
    assert code == 2 and "has no committed documents yet" in err and "may still be running" in err
    assert "larger than the store" not in err


def test_verify_notes_leftovers_of_interrupted_writes_and_exits_0(corpus, capsys) -> None:
    assert run(capsys, "index", corpus / "docs", "--store", corpus / "s")[0] == 0
    leftovers = ["kv/00000099-0123abcd.safetensors", "index-00000099.faiss", ".manifest.json.1234.tmp"]
    for name in leftovers:
        (corpus / "s" / name).write_bytes(b"half-written")
    code, out, _ = run(capsys, "store", "verify", "--store", corpus / "s")
    assert code == 0 and "every checksum and reference is sound" in out
    assert "3 leftover files of interrupted writes" in out and "`pc-rag store compact`/`repair`" in out
    assert all(name in out for name in leftovers)
    assert run(capsys, "store", "compact", "--store", corpus / "s")[0] == 0
    code, out, _ = run(capsys, "store", "verify", "--store", corpus / "s")
    assert code == 0 and "note:" not in out and not any((corpus / "s" / name).exists() for name in leftovers)


def test_ask_skips_a_damaged_chunk_naming_repair_which_encodes_it_again(corpus, capsys, caplog) -> None:
    assert (
        run(capsys, "index", corpus / "docs", "--store", corpus / "s", "--chunk-tokens", "8", "--overlap", "0")[0] == 0
    )
    manifest = Manifest.load(corpus / "s" / MANIFEST_NAME)
    victim = manifest.docs[str(corpus / "docs" / "fuji.md")].chunk_ids[0]
    flip_bytes(corpus / "s", f"{victim}.k")
    everything = str(len(manifest.chunks))
    with caplog.at_level(logging.WARNING):
        code, out, _ = run(capsys, "ask", "--store", corpus / "s", "-k", everything, "--max-new-tokens", "1", "Which?")
    hint = f"`pc-rag store repair --store {corpus / 's'}`"
    warned = [r.getMessage() for r in caplog.records if hint in r.getMessage()]
    assert code == 0 and len(warned) == 1, warned  # answered, warned once
    assert f"skipped, its KV is damaged: chunk {victim} of {corpus / 'docs' / 'fuji.md'}" in out, out
    code, out, _ = run(capsys, "store", "repair", "--store", corpus / "s")
    assert code == 0 and "re-encoded 1 damaged chunks" in out and "dropped 0 damaged documents" in out
    assert run(capsys, "store", "verify", "--store", corpus / "s")[0] == 0
    assert run(capsys, "ask", "--store", corpus / "s", "-k", everything, "--max-new-tokens", "1", "Which?")[0] == 0


def test_repair_clears_a_damaged_shard_header_and_the_hint_prints_once(corpus, capsys) -> None:
    index = ["index", corpus / "docs", "--store", corpus / "s", "--chunk-tokens", "8", "--overlap", "0"]
    assert run(capsys, *index)[0] == 0
    flip_header_byte(corpus / "s", 40)
    code, _, err = run(capsys, "store", "verify", "--store", corpus / "s")
    assert code == 2 and err.count("pc-rag store repair") == 1, err
    code, out, _ = run(capsys, "store", "repair", "--store", corpus / "s")
    assert code == 0 and "dropped 0 damaged documents" in out, out
    assert run(capsys, "store", "verify", "--store", corpus / "s")[0] == 0


def test_index_skips_an_empty_file_in_a_folder_with_a_warning(corpus, capsys, caplog) -> None:
    (corpus / "docs" / "draft.txt").write_text("")
    with caplog.at_level("WARNING"):
        code, out, _ = run(capsys, "index", corpus / "docs", "--store", corpus / "s")
    assert code == 0 and "store: 2 documents" in out
    assert f"skipping {corpus / 'docs' / 'draft.txt'}: it is empty" in caplog.text


def test_index_refuses_two_rows_with_one_id_before_the_model_loads(corpus, capsys, monkeypatch) -> None:
    rows = [{"id": "a", "text": "One."}, {"id": "b", "text": "Two."}, {"id": "c", "text": "Three."}]
    rows.append({"id": "a", "text": "Four."})
    (corpus / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(model, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    code, _, err = run(capsys, "index", corpus / "rows.jsonl", "--store", corpus / "s")
    assert code == 2 and f"rows.jsonl:4: id 'a' is also the id of {corpus / 'rows.jsonl'}:1" in err
    assert not (corpus / "s").exists()


def test_ask_prints_each_source_path_once_and_snippets_on_one_line(corpus, capsys) -> None:
    (corpus / "docs" / "notes.md").write_text("# Notes\n\nThe Rhine\nflows north.\n\nIt ends in the North Sea.\n")
    assert run(capsys, "index", corpus / "docs", "--store", corpus / "s")[0] == 0
    code, out, _ = run(capsys, "ask", "--store", corpus / "s", "-k", "3", "--max-new-tokens", "1", "Rhine?")
    lines = out.split("\nsources:\n")[1].split("\n\n")[0].splitlines()
    assert code == 0 and len(lines) == 3, out
    for line in lines:
        path = next(p for p in (corpus / "docs").iterdir() if str(p) in line)
        assert line.count(str(path)) == 1 and "\\n" not in line, line
    assert any('"# Notes The Rhine flows north. It ends in the North Sea."' in line for line in lines), lines


def test_device_cuda_without_cuda_is_one_line_naming_the_fix(capsys, monkeypatch) -> None:
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    code, out, err = run(capsys, "--device", "cuda", "demo", "--questions", "1")
    assert code == 2 and out == "" and len(err.splitlines()) == 1, err
    assert err.startswith("pc-rag: error: device 'cuda' is not available: ") and "use --device cpu" in err, err
