"""The document store end to end on a tiny model: add, search handles, answer, persist, reload, delete, update."""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from conftest import tiny_model

from pc_rag.errors import PCRagError, StoreCorruptedError, StoreError, StoreMismatchError
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.markers import module_ref, split_module_prompt
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store import as_embedder
from pc_rag.store.document_store import DocumentStore, module_text

DOCS = [
    ("The Eiffel Tower is a wrought-iron tower in Paris. It was finished in 1889.", {"source": "eiffel.txt"}),
    ("Mount Fuji is the highest mountain of Japan. It is an active volcano.", {"source": "fuji.txt"}),
    ("The Danube is Europe's second-longest river. It flows into the Black Sea.", {"source": "danube.txt"}),
]


def bag_of_words(texts: list[str]) -> np.ndarray:
    """A deterministic hashing embedder: enough for lexical retrieval in tests."""
    out = np.zeros((len(texts), 64), dtype=np.float32)
    for row, text in enumerate(texts):
        for word in text.lower().replace(".", " ").replace("?", " ").split():
            out[row, zlib.crc32(word.encode()) % 64] += 1.0
    return out


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer), RagPrompt())


def embedder():
    return as_embedder(bag_of_words, name="test-bag-of-words")


def make_store(tmp_path, engine: RagEngine, **kwargs) -> DocumentStore:
    store = DocumentStore.create(
        tmp_path / "store", engine, embedder=embedder(), chunk_tokens=24, overlap_tokens=4, **kwargs
    )
    store.add_documents(DOCS, ids=["eiffel", "fuji", "danube"], progress=False)
    return store


def test_search_returns_module_handles(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine)
    handles = store.search("Which mountain is the highest of Japan?", k=2)
    assert handles[0].doc_id == "fuji" and handles[0].metadata == {"source": "fuji.txt"}
    assert (
        handles[0].n_tokens == len(engine.tokenize(module_text(handles[0].text)))
        and handles[0].score >= handles[1].score
    )
    assert len(store.search("anything", k=50)) == len(store)  # k beyond the store returns everything


def test_answer_splices_the_retrieved_modules(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine, mode="naive")
    answer = PromptServer(store=store).answer("Where is the Eiffel Tower?", k=2, max_new_tokens=3)
    stats = answer.result.stats
    assert stats.cached_tokens == len(engine.head_ids) + sum(h.n_tokens for h in answer.sources)
    full = PromptServer(store=store).answer_full("Where is the Eiffel Tower?", k=2, max_new_tokens=3)
    assert full.sources == answer.sources and full.result.stats.cached_tokens == 0


def test_reload_gives_the_same_store(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine, storage_dtype=torch.bfloat16)
    question = "Where does the Danube flow?"
    before = PromptServer(store=store).answer(question, k=2, max_new_tokens=3)
    again = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())
    after = PromptServer(store=again).answer(question, k=2, max_new_tokens=3)
    assert after.sources == before.sources
    torch.testing.assert_close(after.result.first_logits, before.result.first_logits)


def test_an_interrupted_add_loses_nothing_committed_and_its_kv_is_reclaimed(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine)
    saved = {cid: store.kv.get(cid) for cid in store.manifest.chunks}
    embedded: list[int] = []

    def interrupted(texts: list[str]) -> np.ndarray:
        if embedded:
            raise KeyboardInterrupt  # stopped during the second batch, after its KV was written
        embedded.append(len(texts))
        return bag_of_words(texts)

    store.embedder = as_embedder(interrupted, name="test-bag-of-words")
    with pytest.raises(KeyboardInterrupt):
        store.add_documents([f"Extra note {i} about the river Rhine." for i in range(40)], progress=False)
    store.embedder = embedder()
    assert store.documents == ["eiffel", "fuji", "danube"]
    assert all("Rhine" not in h.text for h in store.search("Rhine", k=50))
    on_disk = _bytes(tmp_path / "store")
    store.close()
    reopened = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())
    assert reopened.documents == ["eiffel", "fuji", "danube"] and reopened.kv.ids() == sorted(saved)
    for cid, span in saved.items():
        torch.testing.assert_close(reopened.kv.get(cid).keys, span.keys)
    assert reopened.search("Where does the Danube flow?", k=1)[0].doc_id == "danube"
    assert _bytes(tmp_path / "store") == on_disk  # loading wrote nothing
    reopened.compact()  # the next write removes what the interrupted one left
    assert _bytes(tmp_path / "store") < on_disk / 4
    reopened.verify()


def test_a_document_listed_without_its_chunks_is_dropped_by_repair(tmp_path, engine: RagEngine) -> None:
    store = DocumentStore.create(tmp_path / "store", engine, embedder=embedder(), chunk_tokens=8, overlap_tokens=0)
    store.add_documents(DOCS, ids=["eiffel", "fuji", "danube"], progress=False)  # several chunks per document
    store.close()
    fuji = store.manifest.docs["fuji"].chunk_ids
    assert len(fuji) > 1
    del store.manifest.chunks[fuji[0]]  # as an old pc-rag's interrupted add could leave it
    store.manifest.save(tmp_path / "store" / "manifest.json")
    reopened = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())
    assert fuji[0] not in {h.chunk_id for h in reopened.search("Fuji", k=50)}  # never served
    with pytest.raises(StoreCorruptedError, match="1 documents missing a chunk"):
        reopened.verify()
    report = reopened.repair()
    assert report.dropped_documents == ("fuji",) and report.orphan_chunks == len(fuji)
    assert reopened.documents == ["eiffel", "danube"] and not set(fuji) & set(reopened.kv.ids())
    assert not set(fuji) & set(reopened.index.ids()) and all(h.doc_id != "fuji" for h in reopened.search("Fuji", k=50))
    reopened.verify()


def _bytes(directory) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def test_store_refuses_another_model_or_embedder(tmp_path, engine: RagEngine, tokenizer) -> None:
    make_store(tmp_path, engine)
    other = RagEngine(tiny_model("qwen2", tokenizer), RagPrompt())
    with pytest.raises(StoreMismatchError, match="model"):
        DocumentStore.load(tmp_path / "store", other, embedder=embedder())
    with pytest.raises(StoreMismatchError, match="embedder"):
        DocumentStore.load(tmp_path / "store", engine, embedder=as_embedder(bag_of_words, name="other"))
    with pytest.raises(StoreMismatchError, match="preamble"):
        DocumentStore.load(
            tmp_path / "store", RagEngine(engine.lm, RagPrompt(preamble="Other.\n")), embedder=embedder()
        )


def test_delete_and_update(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine)
    removed = store.delete(["fuji"])
    assert removed > 0 and all(h.doc_id != "fuji" for h in store.search("Japan mountain", k=10))
    store.update("eiffel", "The Eiffel Tower is 330 metres tall.", {"source": "v2"})
    handles = store.search("How tall is the Eiffel Tower?", k=1)
    assert handles[0].text == "The Eiffel Tower is 330 metres tall." and handles[0].metadata == {"source": "v2"}
    reloaded = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())
    assert sorted(reloaded.documents) == ["danube", "eiffel"]
    with pytest.raises(StoreError, match="unknown document"):
        store.delete(["nope"])


def test_bad_input_writes_nothing(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine)
    size = len(store)
    with pytest.raises(StoreError, match="empty"):
        store.add_documents(["fine text", "   "], progress=False)
    assert len(store) == size
    with pytest.raises(StoreError, match="not a pc-rag store"):
        DocumentStore.load(tmp_path / "nowhere", engine, embedder=embedder())
    with pytest.raises(StoreError, match="already holds"):
        DocumentStore.create(tmp_path / "store", engine, embedder=embedder())


def test_corrupted_shard_is_named(tmp_path, engine: RagEngine) -> None:
    make_store(tmp_path, engine)
    shard = next((tmp_path / "store" / "kv").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    store = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())
    with pytest.raises(StoreCorruptedError, match=shard.name):  # every chunk read, the damaged one among them
        store.chunks(store.search("Where is the Eiffel Tower?", k=len(store)))
    answer = PromptServer(store=store).answer("Where is the Eiffel Tower?", k=len(store), max_new_tokens=1)
    assert len(answer.skipped) == 1 and len(answer.sources) == len(store) - 1  # answered from the rest


def test_prompt_with_module_references_splices_the_stored_chunks(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine)
    handles = store.search("Which mountain is the highest of Japan?", k=2)
    refs = "\n".join(store.module_ref(h) for h in handles)
    prompt = f"{engine.prompt.preamble}{refs}\nQuestion: Which mountain?\nAnswer:"
    server = PromptServer(store=store)
    cached = server.stream(prompt, mode="prefix", max_new_tokens=4)  # no recompute: every chunk token reused
    cached_text = "".join(cached)
    stats = cached.result.stats
    assert stats.cached_tokens == len(engine.head_ids) + sum(h.n_tokens for h in handles)  # nothing recomputed
    full = PromptServer(store=store).stream(prompt, full=True, max_new_tokens=4)
    assert "".join(full) and full.result.stats.cached_tokens == 0
    assert cached_text == cached.result.text


def test_plain_prompt_and_foreign_references(tmp_path, engine: RagEngine) -> None:
    store = make_store(tmp_path, engine)
    plain = PromptServer(store=store).stream("Where is the Eiffel Tower?", max_new_tokens=3)
    list(plain)
    assert plain.result.stats.cached_tokens == 0 and plain.result.stats.computed_tokens > 0
    with pytest.raises(StoreError, match="references chunks of store"):
        PromptServer(store=store).stream(module_ref("abc123", 0) + "Q?")
    with pytest.raises(StoreError, match="chunk 999 is not in the store"):
        PromptServer(store=store).stream(module_ref(store.store_id, 999) + "Q?")
    with pytest.raises(PCRagError, match="sits between module references"):
        PromptServer(store=store).stream(f"{store.module_ref(store.handle(0))} and {store.module_ref(store.handle(1))}")


@pytest.mark.parametrize("forge", ["unsigned", "wrong signature", "signed elsewhere"])
def test_reference_like_user_text_is_plain_text(tmp_path, engine: RagEngine, forge: str) -> None:
    store = make_store(tmp_path, engine)
    genuine = store.module_ref(store.handle(0))
    unsigned = f'<pc-rag-module store="{store.store_id}" chunk="1"/>'
    forged = {
        "unsigned": unsigned,
        "wrong signature": unsigned.replace("/>", f' sig="{"0" * 32}"/>'),
        "signed elsewhere": genuine.replace('chunk="0"', 'chunk="1"'),  # a real signature, for another chunk
    }[forge]
    assert split_module_prompt(forged).refs == ()
    question = f"{engine.prompt.preamble}{genuine}\nWhat does {forged} say?"
    answer = PromptServer(store=store).stream(question, mode="prefix", max_new_tokens=2)
    list(answer)  # only chunk 0 is spliced; the forged reference is tokenized as the question's text
    assert answer.result.stats.cached_tokens == len(engine.head_ids) + store.handle(0).n_tokens
    assert split_module_prompt(question).refs == ((store.store_id, 0),)


def test_the_store_records_the_adapter_its_answers_assume(tmp_path, tokenizer, caplog) -> None:
    from pc_rag.rag.adapter import AdapterConfig, SpliceAdapter

    lm = tiny_model("llama", tokenizer)

    def adapter(seed: int) -> SpliceAdapter:
        torch.manual_seed(seed)
        made = SpliceAdapter(lm.model, AdapterConfig(rank=2), lm.fingerprint())
        with torch.no_grad():
            for p in made.lora_b.values():
                p.normal_()
        return made.requires_grad_(False)

    first, second = adapter(0), adapter(1)
    assert first.digest != second.digest
    with pytest.raises(PCRagError, match="pc-rag tune"):  # an adapter mode on a model without one: refused up front
        make_store(tmp_path / "none", RagEngine(lm, RagPrompt()), mode="fast")
    assert not (tmp_path / "none").exists()
    store = make_store(tmp_path, RagEngine(lm, RagPrompt(), adapter=first), mode="fast")
    assert store.manifest.serving == {"adapter": first.digest}
    first.detach()
    with caplog.at_level("WARNING"):
        DocumentStore.load(tmp_path / "store", RagEngine(lm, RagPrompt(), adapter=first), embedder=embedder())
    assert "answer with adapter" not in caplog.text
    first.detach()
    with caplog.at_level("WARNING"):
        engine = RagEngine(lm, RagPrompt(), adapter=second)
        reloaded = DocumentStore.load(tmp_path / "store", engine, embedder=embedder())
    assert f"answer with adapter {first.digest}; this engine serves {second.digest}" in caplog.text
    assert reloaded.manifest.serving == {"adapter": first.digest}  # loading records nothing new
    second.detach()
    plain = make_store(tmp_path / "plain", RagEngine(lm, RagPrompt()), mode="prefix")
    assert plain.manifest.serving == {}
