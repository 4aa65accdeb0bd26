"""The LangChain adapters on a tiny model: an LCEL chain reuses the retrieved modules and answers like the store."""

from __future__ import annotations

import asyncio

import pytest
from conftest import tiny_model
from langchain_core.callbacks import AsyncCallbackHandler, BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.runnables import RunnablePassthrough
from pydantic import ValidationError
from test_document_store import DOCS, bag_of_words

from pc_rag.engine import PromptCache
from pc_rag.errors import PCRagError, StoreError
from pc_rag.integrations.langchain import (
    PromptCacheLLM,
    PromptCacheVectorStore,
    PromptModuleRetriever,
    format_modules,
    module_prompt_template,
)
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.markers import module_ref, split_module_prompt
from pc_rag.rag.order import DEFAULT_ORDER, ORDERS
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store import as_embedder
from pc_rag.store.document_store import DocumentStore

QUESTION = "Which mountain is the highest of Japan?"
LONG = " ".join(f"Sentence {i} talks about the river number {i}." for i in range(12))


@pytest.fixture(scope="module")
def engine(tokenizer) -> RagEngine:
    return RagEngine(tiny_model("llama", tokenizer), RagPrompt())


@pytest.fixture(scope="module")
def store(tmp_path_factory, engine: RagEngine) -> DocumentStore:
    store = DocumentStore.create(
        tmp_path_factory.mktemp("lc") / "store", engine, embedder=as_embedder(bag_of_words, name="bow"),
        chunk_tokens=24, overlap_tokens=4,
    )  # fmt: skip
    store.add_documents(DOCS, ids=["eiffel", "fuji", "danube"], progress=False)
    return store


def rag_chain(store: DocumentStore, llm: PromptCacheLLM, k: int = 2, order: str = DEFAULT_ORDER):
    retriever = PromptModuleRetriever(store=store, k=k, order=order)
    context = {"context": retriever | format_modules, "question": RunnablePassthrough()}
    return context | module_prompt_template(store) | llm


def tail_tokens(engine: RagEngine, question: str) -> int:
    return len(engine.tokenize(engine.prompt.tail(engine.wrappers, question)))


@pytest.mark.parametrize(("mode", "edge"), [("prefix", 0), ("edge", 16)])
def test_chain_splices_the_retrieved_modules_and_answers_like_the_store(
    store: DocumentStore, engine: RagEngine, mode: str, edge: int
) -> None:
    llm = PromptCacheLLM.from_store(store, mode=mode, max_tokens=6)
    answer = rag_chain(store, llm).invoke(QUESTION)
    direct = PromptServer(store=store).answer(QUESTION, k=2, mode=mode, max_new_tokens=6)
    assert answer == direct.text
    chunk_tokens = [h.n_tokens for h in direct.sources]
    recomputed = sum(min(n, edge) for n in chunk_tokens)
    stats = llm.last_stats
    assert stats.cached_tokens == len(engine.head_ids) + sum(chunk_tokens) - recomputed  # preamble reused too
    assert stats.computed_tokens == tail_tokens(engine, QUESTION) + recomputed


def test_chain_prompt_is_served_like_the_store_serves_it(store: DocumentStore) -> None:
    llm = PromptCacheLLM.from_store(store, mode="prefix", max_tokens=5)
    retriever = PromptModuleRetriever(store=store, k=3)
    prompt = module_prompt_template(store).format(context=format_modules(retriever.invoke(QUESTION)), question="Q?")
    direct = PromptServer(store=store).stream(prompt, mode="prefix", max_new_tokens=5)
    assert llm.invoke(prompt) == "".join(direct)
    full = PromptServer(store=store).stream(prompt, full=True, max_new_tokens=5)
    list(full)
    assert full.result.stats.cached_tokens == 0 < llm.last_stats.cached_tokens


def test_retriever_documents_carry_handles(store: DocumentStore) -> None:
    docs = PromptModuleRetriever(store=store, k=2, order="best-first").invoke(QUESTION)
    handles = store.search(QUESTION, k=2)
    assert [d.page_content for d in docs] == [h.text for h in handles]
    top = docs[0]
    assert top.id == "fuji" and top.metadata["source"] == "fuji.txt" and top.metadata["store_id"] == store.store_id
    assert top.metadata["chunk_id"] == handles[0].chunk_id and top.metadata["n_tokens"] == handles[0].n_tokens
    assert docs[0].metadata["score"] >= docs[1].metadata["score"]
    refs = split_module_prompt(format_modules(docs)).refs
    assert refs == tuple((store.store_id, h.chunk_id) for h in handles)


@pytest.mark.parametrize("order", ORDERS)
def test_retriever_order_is_the_layout_the_chain_answers_from(store: DocumentStore, order: str) -> None:
    docs = PromptModuleRetriever(store=store, k=3, order=order).invoke(QUESTION)
    assert [d.metadata["chunk_id"] for d in docs] == [h.chunk_id for h in store.search(QUESTION, 3, order)]
    llm = PromptCacheLLM.from_store(store, mode="prefix", max_tokens=4)
    direct = PromptServer(store=store).answer(QUESTION, k=3, mode="prefix", order=order, max_new_tokens=4)
    assert rag_chain(store, llm, k=3, order=order).invoke(QUESTION) == direct.text
    with pytest.raises(PCRagError, match="unknown chunk order 'random'"):
        PromptModuleRetriever(store=store, order="random")


def test_format_modules_refuses_documents_without_a_handle() -> None:
    with pytest.raises(PCRagError, match="carries no prompt-module handle"):
        format_modules([Document(page_content="plain text")])


def test_stream_equals_invoke_and_reports_tokens(store: DocumentStore) -> None:
    class Tokens(BaseCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        def on_llm_new_token(self, token: str, **kwargs: object) -> None:
            self.tokens.append(token)

    llm = PromptCacheLLM.from_store(store, max_tokens=8)
    prompt = module_prompt_template(store).format(context=format_modules([]), question=QUESTION)
    handler = Tokens()
    pieces = list(llm.stream(prompt, config={"callbacks": [handler]}))
    assert "".join(pieces) == llm.invoke(prompt) and handler.tokens == [p for p in pieces if p]
    result = llm.generate([prompt])
    info = result.generations[0][0].generation_info
    assert info["cached_tokens"] == 0 and info["new_tokens"] <= 8 and info["ttft_ms"] > 0  # no refs: full prefill
    assert result.llm_output == {"model_name": "tiny-llama", "store_id": store.store_id}


def test_async_and_batch_equal_sync(store: DocumentStore) -> None:
    class AsyncTokens(AsyncCallbackHandler):
        def __init__(self) -> None:
            self.tokens: list[str] = []

        async def on_llm_new_token(self, token: str, **kwargs: object) -> None:
            self.tokens.append(token)

    llm = PromptCacheLLM.from_store(store, mode="prefix", max_tokens=5)
    chain = rag_chain(store, llm)
    questions = [QUESTION, "Where does the Danube flow?"]
    expected = [PromptServer(store=store).answer(q, k=2, mode="prefix", max_new_tokens=5).text for q in questions]
    handler = AsyncTokens()

    async def run() -> tuple[list[str], str, list[str]]:
        batch = await chain.abatch(questions)
        streamed = [p async for p in chain.astream(questions[1], config={"callbacks": [handler]})]
        return batch, await chain.ainvoke(questions[0]), streamed

    abatch, ainvoke, astream = asyncio.run(run())
    assert chain.batch(questions) == abatch == expected and ainvoke == expected[0]
    assert "".join(astream) == expected[1] and "".join(handler.tokens) == expected[1]


def test_generation_settings(store: DocumentStore) -> None:
    llm = PromptCacheLLM.from_store(store)
    prompt = f"{store.engine.prompt.preamble}{store.module_ref(store.handle(0))}\nWhat is it?"
    llm.invoke(prompt, max_tokens=3)  # sampling settings and stop: test_generation_settings.py
    assert llm.last_stats.new_tokens == 3
    with pytest.raises(PCRagError, match="unknown generation settings"):
        llm.invoke(prompt, max_new_tokens=3)
    with pytest.raises(ValidationError):
        PromptCacheLLM.from_store(store, top_p=0.0)
    with pytest.raises(ValidationError):
        PromptCacheLLM.from_store(store, temprature=0.5)  # extra fields are refused, not ignored


def test_identity_and_token_counts(store: DocumentStore, engine: RagEngine) -> None:
    llm = PromptCacheLLM.from_store(store, mode="edge")
    params = llm._identifying_params
    assert params["model_name"] == "tiny-llama" and params["store_id"] == store.store_id and params["mode"] == "edge"
    assert params["store_identity"]["preamble_hash"] == engine.prompt.digest()
    assert llm.get_num_tokens("Mount Fuji") == len(engine.tokenize("Mount Fuji"))  # the model's tokenizer, offline


def test_bad_references_raise_store_errors(store: DocumentStore) -> None:
    llm = PromptCacheLLM.from_store(store, max_tokens=2)
    with pytest.raises(StoreError, match="chunk 999 is not in the store"):
        llm.invoke(module_ref(store.store_id, 999) + "Q?")


def test_pml_prompts_reuse_schema_modules(engine: RagEngine) -> None:
    cache = PromptCache(engine.lm)
    cache.add_schema('<schema name="s"><module name="doc">The sky is blue.</module></schema>')
    llm = PromptCacheLLM.from_prompt_cache(cache, max_tokens=3)
    prompt = '<prompt schema="s"><doc/>What color?</prompt>'
    assert llm.invoke(prompt) == cache.generate(prompt, max_new_tokens=3).text
    assert llm.last_stats.cached_tokens > 0


def test_vectorstore_indexes_chunks_and_returns_whole_documents(tmp_path, engine: RagEngine) -> None:
    with pytest.raises(PCRagError, match="needs engine"):
        PromptCacheVectorStore.from_texts(["x"], None, directory=tmp_path / "nope")
    vs = PromptCacheVectorStore.from_texts(
        [LONG, DOCS[1][0]], as_embedder(bag_of_words, name="bow"), [{"source": "long"}, {"source": "fuji"}],
        ids=["long", "fuji"], engine=engine, directory=tmp_path / "vs", chunk_tokens=24, overlap_tokens=4,
    )  # fmt: skip
    store = vs.store
    assert len(store.manifest.docs["long"].chunk_ids) > 2  # the long text was split
    assert [d.page_content for d in vs.get_by_ids(["fuji", "long", "missing"])] == [DOCS[1][0], LONG]
    hits = vs.similarity_search_with_score("river number 7", k=3)
    assert all(doc.id == "long" and doc.metadata == {"source": "long"} and doc.page_content in LONG for doc, _ in hits)
    assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
    assert vs.embeddings.embed_query("river") == store.embedder.embed_query("river").tolist()
    vs.delete(["long", "missing"])
    assert store.documents == ["fuji"] and vs.similarity_search("river", k=5)[0].id == "fuji"
    with pytest.raises(PCRagError, match="no metadata filters"):
        vs.similarity_search("river", k=1, filter={"source": "fuji"})


def test_vectorstore_retriever_drives_a_cached_chain(tmp_path, engine: RagEngine) -> None:
    vs = PromptCacheVectorStore.from_texts(
        [t for t, _ in DOCS], as_embedder(bag_of_words, name="bow"), [m for _, m in DOCS], engine=engine,
        directory=tmp_path / "vs", mode="prefix",
    )  # fmt: skip
    retriever = vs.as_retriever(search_kwargs={"k": 2})
    assert isinstance(retriever, PromptModuleRetriever) and retriever.k == 2
    assert vs.as_retriever(order="best-last").order == "best-last"
    llm = PromptCacheLLM.from_store(vs.store, max_tokens=4)
    chain = (
        {"context": retriever | format_modules, "question": RunnablePassthrough()}
        | module_prompt_template(vs.store)
        | llm
    )
    assert chain.invoke(QUESTION) == PromptServer(store=vs.store).answer(QUESTION, k=2, max_new_tokens=4).text
    with pytest.raises(PCRagError, match="search_type='similarity'"):
        vs.as_retriever(search_type="mmr")


def test_batched_llm_decodes_a_batch_together_and_answers_as_alone(tmp_path, tokenizer) -> None:
    from conftest import tiny_model
    from test_document_store import make_store

    from pc_rag.integrations.langchain import PromptCacheLLM
    from pc_rag.rag import RagEngine, RagPrompt

    store = make_store(tmp_path, RagEngine(tiny_model("llama", tokenizer), RagPrompt()))
    questions = ["Which city has the tower?", "Is Fuji a volcano?", "Where does the Danube end?"]
    prompts = ["".join(store.module_ref(h) for h in store.search(q, k=2)) + q for q in questions]
    alone = PromptCacheLLM.from_store(store, max_tokens=6)
    batched = PromptCacheLLM.from_store(store, batched=True, max_tokens=6)
    steps = []
    original = batched.server.scheduler._step_batch
    batched.server.scheduler._step_batch = lambda: (steps.append(len(batched.server.scheduler._rows)), original())[1]
    assert batched.batch(prompts) == [alone.invoke(p) for p in prompts]
    assert max(steps) > 1  # decode steps served several requests at once
    batched.server.scheduler.close()
