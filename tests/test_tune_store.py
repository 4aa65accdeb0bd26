"""``tune --store``: pairs from a store's own chunks (questions the model writes, contexts the store retrieves),
a stable held-out split, resumption, and an adapter that ``fast`` serves."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
from conftest import tiny_model
from test_document_store import embedder

from pc_rag.errors import PCRagError
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.adapter import AdapterConfig, SpliceAdapter
from pc_rag.rag.tuned import adapter_file, tuned_dirs
from pc_rag.runtime.generate import eos_ids
from pc_rag.store.document_store import DocumentStore
from pc_rag.tune import store_pairs
from pc_rag.tune.install import install
from pc_rag.tune.questions import INSTRUCTION, MAX_NEW_TOKENS, clean_question, question_prompt, write_question
from pc_rag.tune.store_command import tune_store
from pc_rag.tune.store_pairs import StorePairSource, held_out_documents
from pc_rag.tune.teacher import TeacherSet, build_teacher
from pc_rag.tune.train import TrainConfig

TOPICS = ["Eiffel Tower", "Mount Fuji", "Danube", "Amazon", "Sahara", "Everest", "Nile", "Alps", "Rhine", "Gobi"]
DOCS = {
    f"doc{i}": f"The {t} is famous. Travellers visit the {t} every year, and books describe the {t} at length."
    for i, t in enumerate(TOPICS)
}


def asks_about(engine: RagEngine, passage: str) -> str:
    """A stand-in writer for the tiny random model, whose replies share no word with the passage."""
    return f"Question: What does the passage say about {max(re.findall('[A-Za-z]{4,}', passage), key=len)}?"


@pytest.fixture(autouse=True)
def writer(monkeypatch) -> None:
    monkeypatch.setattr(store_pairs, "write_question", asks_about)


@pytest.fixture(scope="module")
def store(tmp_path_factory, tokenizer):
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())
    directory = tmp_path_factory.mktemp("tune-store") / "store"
    with DocumentStore.create(directory, engine, embedder=embedder(), chunk_tokens=16, overlap_tokens=2) as s:
        s.add_documents([(t, {}) for t in DOCS.values()], ids=list(DOCS), progress=False)
    loaded = DocumentStore.load(directory, engine, embedder=embedder())
    yield loaded
    loaded.close()


def test_held_out_documents_are_stable_and_about_the_share() -> None:
    ids = [f"doc-{i}" for i in range(2000)]
    held = held_out_documents(ids, 0.1)
    assert 150 < len(held) < 250
    assert held_out_documents(random.Random(0).sample(ids, len(ids)), 0.1) == held  # not the order given
    assert held_out_documents(ids[:1000], 0.1) == held & set(ids[:1000])  # nor the other documents
    assert len(held_out_documents(["a", "b"], 0.01)) == 1  # a tiny store still holds one document out


def test_pairs_come_from_the_store_with_a_disjoint_held_out_part_and_a_rerun_writes_nothing(store, tmp_path) -> None:
    source = StorePairSource(store, tmp_path, pairs=6, k=3, held_out=0.2)
    assert source.write_questions(progress=False) >= 6
    pairs = list(source.pairs())
    assert [p.split for p in pairs].count("val") == 1 and [p.split for p in pairs].count("train") == 5
    held = held_out_documents(store.manifest.docs, 0.2)
    for pair in pairs:
        chunks = source.chunks(pair)
        assert len(chunks) == 3 and pair.question.strip()
        docs = {store.manifest.chunks[int(c)].doc_id for c in pair.doc_ids}
        record = source.records[pair.key]
        source_doc = next(d for d in DOCS if source._ids[record.key] in store.manifest.docs[d].chunk_ids)
        assert (source_doc in held) == (pair.split == "val")
        if pair.split == "train":
            assert not docs & held  # a training context never shows a held-out document
    teacher = TeacherSet(tmp_path / "teacher")
    assert build_teacher(source, teacher, progress=False) == 6

    def refuse(engine, passage):
        raise AssertionError("a rerun wrote a question again")

    again = StorePairSource(store, tmp_path, pairs=6, k=3, held_out=0.2, write=refuse)
    assert again.write_questions(progress=False) == 0 and list(again.pairs()) == pairs
    assert build_teacher(again, TeacherSet(tmp_path / "teacher"), progress=False) == 0
    with pytest.raises(PCRagError, match="another k"):
        StorePairSource(store, tmp_path, pairs=6, k=2, held_out=0.2)


def test_a_crash_mid_line_loses_only_that_question(store, tmp_path) -> None:
    StorePairSource(store, tmp_path, pairs=3, k=2).write_questions(progress=False)
    lines = (tmp_path / "questions.jsonl").read_text().splitlines()
    (tmp_path / "questions.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])
    calls = []
    source = StorePairSource(store, tmp_path, pairs=3, k=2, write=lambda e, p: calls.append(p) or asks_about(e, p))
    source.write_questions(progress=False)
    assert len(calls) == 1 and len(list(source.pairs())) == 3


def test_the_question_is_the_models_greedy_reply_to_the_passage(store) -> None:
    engine, passage = store.engine, DOCS["doc3"]
    prompt = question_prompt(engine, passage)
    assert passage in prompt and INSTRUCTION in prompt
    ids = torch.tensor([engine.tokenize(prompt)])
    lm = engine.lm
    greedy = lm.model.generate(
        ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=list(eos_ids(lm.model, lm.tokenizer))
    )
    reply = [t for t in greedy[0, ids.shape[1] :].tolist() if t not in eos_ids(lm.model, lm.tokenizer)]
    assert write_question(engine, passage) == lm.tokenizer.decode(reply).rstrip("\ufffd")  # bar a cut-off character


def test_questions_are_cleaned_or_refused() -> None:
    passage = "The Danube flows through Vienna and ends in the Black Sea."
    wrapped = 'What is the answer to this question: What is the answer to the question: "Where does the Danube end?"'
    for raw in ['\n Question: "Where does the Danube end?" It ends in the Black Sea.', wrapped]:
        assert clean_question(raw, passage) == "Where does the Danube end?"
    generic = ["What is the answer to this question?", "What is the passage about?", "Which sport is this?"]
    for degenerate in ["", "   \n", "Why?", "the the the the the the", "1 2 3 4", " ".join(["word"] * 50), *generic]:
        assert clean_question(degenerate, passage) is None, degenerate
    assert clean_question("Which sport is this?") == "Which sport is this?"  # no passage: not checked against one


def test_training_writes_an_adapter_that_fast_serves_once_installed(store, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PC_RAG_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("pc_rag.tune.store_command.MIN_PAIRS", {"train": 1, "val": 1})
    engine = store.engine
    out = tmp_path / "new.safetensors"
    config = TrainConfig(epochs=1, lr=5e-3, accumulate=1, eval_every=2, patience=5)
    summary = tune_store(store, tmp_path / "work", out, pairs=4, k=2, held_out=0.2,
                         adapter_config=AdapterConfig(rank=2), train_config=config, progress=False)  # fmt: skip
    assert summary["train_pairs"] == 3 and summary["val_pairs"] == 1 and summary["history"][-1]["pairs_seen"] == 3
    cost = json.loads(out.with_suffix(".json").read_text())["cost"]
    assert cost["questions_count"] >= 4 and cost["teacher_count"] == 4 and cost["train_count"] == 3
    assert summary["installed"] is None and not tuned_dirs()[0].exists()  # nothing installed, nothing written there
    assert install(out).path == tuned_dirs()[0] / adapter_file(engine.lm.fingerprint())
    served = RagEngine(engine.lm, RagPrompt.longbench())  # finds the adapter itself, as serving does
    chunks = store.chunks(store.search("Where is the Nile?", 2))
    try:
        assert served.answer(chunks, "Where is the Nile?", "fast", max_new_tokens=2).token_ids
        written = SpliceAdapter.load(out, engine.lm.model, engine.lm.fingerprint())
        assert served.tuned.adapter().digest == written.digest
    finally:
        served.tuned.adapter().detach()
