"""Open retrieval on a tiny model: passages pooled once per dataset, top-k retrieved, supporting recall reported."""

from __future__ import annotations

import pytest
from conftest import tiny_model
from test_document_store import bag_of_words

from pc_rag.eval import aggregate, results_json, run_eval
from pc_rag.eval.contexts import OpenContexts, passage_id
from pc_rag.eval.datasets import Example, Passage
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.store import as_embedder

FACTS = {
    "Danube": "The Danube flows into the Black Sea.",
    "Fuji": "Mount Fuji is the highest mountain of Japan.",
    "Eiffel": "The Eiffel Tower was finished in 1889.",
    "Rhine": "The Rhine flows through Basel and Cologne.",
}


def example(i: int, subject: str, question: str) -> Example:
    passages = tuple(Passage(t, x, is_supporting=t == subject) for t, x in FACTS.items())
    return Example("toy", str(i), question, (subject,), passages)


EXAMPLES = [
    example(0, "Danube", "Which river flows into the Black Sea?"),
    example(1, "Fuji", "Which mountain is the highest of Japan?"),
]


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer), RagPrompt.longbench())


def embedder():
    return as_embedder(bag_of_words, name="test-bag-of-words")


def test_open_retrieval_records_recall_and_reuses_the_pool(tmp_path, engine: RagEngine) -> None:
    contexts = OpenContexts(engine, EXAMPLES, k=2, directory=tmp_path, embedder=embedder())
    records = run_eval(engine, EXAMPLES, ["full", "naive", "default"], contexts, max_new_tokens=2, progress=False)
    assert {r.setting for r in records} == {"open"} and len(records) == 6
    assert all(r.retrieval_recall == 1.0 for r in records)  # the supporting passage is the lexical best match
    chunks = contexts.chunks(EXAMPLES[0], "default")
    assert len(chunks) == 2 and chunks[0].text.startswith("Danube\n")
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n.rsplit("-", 1)[1] for n in names] == ["conditioned", "isolated"]
    assert len({n.rsplit("-", 1)[0] for n in names}) == 1  # one pool: the same name for both encodings
    store = contexts._store("toy", conditioned=True)
    assert len(store) == len(FACTS)  # each passage once, one chunk each, although every example lists it
    assert {passage_id(p) for p in EXAMPLES[0].passages} == set(store.documents)
    row = next(r for r in results_json(aggregate(records))["results"] if r["mode"] == "default")
    assert row["setting"] == "open" and row["retrieval_recall"] == 1.0
    reopened = OpenContexts(engine, EXAMPLES, k=1, directory=tmp_path, embedder=embedder())
    assert reopened.recall(EXAMPLES[1]) == 1.0 and len(reopened.chunks(EXAMPLES[1], "naive")) == 1


def test_a_different_pool_gets_its_own_store(tmp_path, engine: RagEngine) -> None:
    OpenContexts(engine, EXAMPLES, k=1, directory=tmp_path, embedder=embedder())._store("toy", conditioned=True)
    smaller = [Example("toy", "0", "Which river?", ("Danube",), EXAMPLES[0].passages[:2])]
    store = OpenContexts(engine, smaller, k=1, directory=tmp_path, embedder=embedder())._store("toy", conditioned=True)
    assert len(store) == 2 and len(list(tmp_path.iterdir())) == 2  # not the four-passage store of the first pool


def test_an_interrupted_store_build_resumes(tmp_path, engine: RagEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    from pc_rag.store.document_store import DocumentStore

    added: list[list[str]] = []
    interrupt = [True]
    real_part = DocumentStore._add_part

    def add_part(self, pieces, bar, workers):
        if interrupt[0] and added:
            raise KeyboardInterrupt  # the user stops the build during its second part
        added.append([doc_id for doc_id, *_ in pieces])
        return real_part(self, pieces, bar, workers)

    monkeypatch.setattr(DocumentStore, "_add_part", add_part)
    contexts = OpenContexts(engine, EXAMPLES, k=1, directory=tmp_path, embedder=embedder())
    contexts.build_part = 3
    with pytest.raises(KeyboardInterrupt):
        contexts._store("toy", conditioned=True)
    interrupt[0] = False
    store = OpenContexts(engine, EXAMPLES, k=1, directory=tmp_path, embedder=embedder())._store("toy", conditioned=True)
    assert [len(part) for part in added] == [3, 1]  # the saved first part was kept, only the rest was encoded
    assert set(store.documents) == {passage_id(p) for p in EXAMPLES[0].passages} and len(store) == len(FACTS)


def test_each_order_is_its_own_setting_over_the_same_stores(tmp_path, engine: RagEngine) -> None:
    contexts = OpenContexts(engine, EXAMPLES, k=3, directory=tmp_path, embedder=embedder())
    ranked = [c.text for c in contexts.chunks(EXAMPLES[0], "prefix")]
    assert contexts.setting == "open" and ranked[0].startswith("Danube\n")
    for order, layout in [("best-last", [2, 1, 0]), ("lost-in-the-middle", [0, 2, 1])]:
        reordered = contexts.in_order(order)
        assert reordered.setting == f"open:{order}" and contexts.setting == "open"
        assert [c.text for c in reordered.chunks(EXAMPLES[0], "prefix")] == [ranked[i] for i in layout]
        assert reordered.recall(EXAMPLES[0]) == contexts.recall(EXAMPLES[0]) == 1.0
    assert len(list(tmp_path.iterdir())) == 1  # one store, whatever the order
