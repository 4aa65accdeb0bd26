"""The LlamaIndex path end to end on a tiny model: index, retrieve handle nodes, answer from cached modules, stream.

Properties: the query engine's answer is the store's own answer for the same
references; with ``prefix`` recovery no chunk token is computed; the stock
``RetrieverQueryEngine`` answers too, by full prefill of the chunk text. No test
touches the network (sockets are refused) or LlamaIndex's global ``Settings``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from conftest import tiny_model
from llama_index.core.postprocessor import SimilarityPostprocessor
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import MetadataMode, TextNode
from test_document_store import bag_of_words

from pc_rag.engine import PromptCache
from pc_rag.errors import PCRagError
from pc_rag.integrations.llama_index import (
    PromptCacheLLM,
    PromptCacheQueryEngine,
    PromptModuleRetriever,
    module_qa_template,
)
from pc_rag.integrations.llama_index_query import STATS_KEY
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.order import ORDERS
from pc_rag.retrievers.llama_index import HANDLE_KEYS, node_handle
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store import as_embedder
from pc_rag.store.document_store import DocumentStore

DOCS = [
    ("The Eiffel Tower is a wrought-iron tower in Paris. It was finished in 1889.", {"source": "eiffel.txt"}),
    ("Mount Fuji is the highest mountain of Japan. It is an active volcano.", {"source": "fuji.txt"}),
    ("The Danube is Europe's second-longest river. It flows into the Black Sea.", {"source": "danube.txt"}),
]
QUESTION = "Which mountain is the highest of Japan?"
NEW = 4  # new tokens per answer: enough to compare texts, cheap on two cores


pytestmark = pytest.mark.usefixtures("no_network")  # LlamaIndex must not fetch anything


@pytest.fixture(scope="module")
def store(tokenizer, tmp_path_factory) -> DocumentStore:
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt(), canonical_gap=16)
    store = DocumentStore.create(
        tmp_path_factory.mktemp("li") / "store",
        engine,
        embedder=as_embedder(bag_of_words, name="test-bag-of-words"),
        chunk_tokens=24,
        overlap_tokens=4,
        mode="prefix",  # chunks encoded after the preamble, nothing recomputed: token counts are exact
    )
    store.add_documents(DOCS, ids=["eiffel", "fuji", "danube"], progress=False)
    return store


def test_retriever_returns_nodes_carrying_their_handles(store: DocumentStore) -> None:
    nodes = PromptModuleRetriever(store, similarity_top_k=2, order="best-first").retrieve(QUESTION)
    handles = store.search(QUESTION, k=2)
    assert [node_handle(store, n) for n in nodes] == handles
    best = nodes[0].node
    assert best.get_content() == handles[0].text and best.ref_doc_id == "fuji"
    assert best.metadata["source"] == "fuji.txt" and best.metadata["store_id"] == store.store_id
    for mode in (MetadataMode.LLM, MetadataMode.EMBED):  # the chunk's own metadata is shown, the handle is not
        content = best.get_content(metadata_mode=mode)
        assert "fuji.txt" in content and not any(f"{key}:" in content for key in HANDLE_KEYS)
    assert nodes[0].score >= nodes[1].score


@pytest.mark.parametrize("mode", [None, "edge"])
def test_query_engine_answers_as_the_store_does(store: DocumentStore, mode: str | None) -> None:
    engine = PromptCacheQueryEngine.from_store(store, 2, mode=mode, max_new_tokens=NEW)
    response = engine.query(QUESTION)
    native = PromptServer(store=store).answer(QUESTION, k=2, mode=mode, max_new_tokens=NEW)
    assert response.response == native.text
    assert [node_handle(store, n) for n in response.source_nodes] == list(native.sources)  # best first
    stats = response.metadata[STATS_KEY]
    assert (stats["cached_tokens"], stats["computed_tokens"]) == (
        native.result.stats.cached_tokens,
        native.result.stats.computed_tokens,
    )
    prompt = engine.prompt(QUESTION, engine.retrieve(QUESTION))  # the layout: the retriever's order
    assert prompt.startswith(store.engine.prompt.preamble)
    assert "".join(PromptServer(store=store).stream(prompt, mode=mode, max_new_tokens=NEW)) == response.response


@pytest.mark.parametrize("order", ORDERS)
def test_retriever_lays_out_nodes_in_its_order(store: DocumentStore, order: str) -> None:
    nodes = PromptModuleRetriever(store, similarity_top_k=3, order=order).retrieve(QUESTION)
    assert [node_handle(store, n) for n in nodes] == store.search(QUESTION, k=3, order=order)
    with pytest.raises(PCRagError, match="unknown chunk order 'random'"):
        PromptModuleRetriever(store, order="random")


@pytest.mark.parametrize("order", ORDERS)
def test_query_engine_answers_from_the_retrievers_order(store: DocumentStore, order: str) -> None:
    response = PromptCacheQueryEngine.from_store(store, 3, order=order, max_new_tokens=NEW).query(QUESTION)
    native = PromptServer(store=store).answer(QUESTION, k=3, order=order, max_new_tokens=NEW)
    assert [node_handle(store, n) for n in response.source_nodes] == list(native.sources)  # best first, any layout
    assert [n.score for n in response.source_nodes] == sorted((n.score for n in response.source_nodes), reverse=True)
    assert response.response == native.text


def test_prefix_mode_computes_no_chunk_token(store: DocumentStore) -> None:
    response = PromptCacheQueryEngine.from_store(store, 3, max_new_tokens=NEW).query(QUESTION)
    chunks = sum(n.node.metadata["n_tokens"] for n in response.source_nodes)
    stats = response.metadata[STATS_KEY]
    assert len(response.source_nodes) == 3
    assert stats["cached_tokens"] == len(store.engine.head_ids) + chunks
    assert stats["computed_tokens"] < chunks  # only the question and the turn's end


def test_postprocessors_choose_which_modules_are_spliced(store: DocumentStore) -> None:
    engine = PromptCacheQueryEngine.from_store(store, 3, max_new_tokens=NEW)
    cutoff = max(n.score for n in engine.retrieve(QUESTION)) - 1e-6  # keeps the best node only
    engine.node_postprocessors = [SimilarityPostprocessor(similarity_cutoff=cutoff)]
    response = engine.query(QUESTION)
    (kept,) = response.source_nodes
    stats = response.metadata[STATS_KEY]
    assert stats["cached_tokens"] == len(store.engine.head_ids) + kept.node.metadata["n_tokens"]


def test_streaming_query_yields_the_same_answer(store: DocumentStore) -> None:
    answer = PromptCacheQueryEngine.from_store(store, 2, max_new_tokens=NEW).query(QUESTION)
    streaming = PromptCacheQueryEngine.from_store(store, 2, max_new_tokens=NEW, streaming=True).query(QUESTION)
    assert STATS_KEY not in streaming.metadata  # filled in when the stream ends
    deltas = list(streaming.response_gen)
    assert len(deltas) > 1 and "".join(deltas) == answer.response
    assert streaming.metadata[STATS_KEY]["cached_tokens"] == answer.metadata[STATS_KEY]["cached_tokens"]
    assert [n.node.node_id for n in streaming.source_nodes] == [n.node.node_id for n in answer.source_nodes]


def test_async_query(store: DocumentStore) -> None:
    engine = PromptCacheQueryEngine.from_store(store, 2, max_new_tokens=NEW)
    assert asyncio.run(engine.aquery(QUESTION)).response == engine.query(QUESTION).response


@pytest.mark.parametrize("streaming", [False, True])
def test_stock_retriever_query_engine_is_served_by_full_prefill(store: DocumentStore, streaming: bool) -> None:
    """LlamaIndex's own engine puts chunk text in its QA template: correct, but nothing is reused."""
    llm = PromptCacheLLM.from_store(store, max_new_tokens=NEW)
    retriever = PromptModuleRetriever(store, similarity_top_k=2)
    engine = RetrieverQueryEngine.from_args(retriever, llm=llm, response_mode="compact", streaming=streaming)
    response = engine.query(QUESTION)
    text = "".join(response.response_gen) if streaming else response.response
    assert text and len(response.source_nodes) == 2
    chunks = sum(n.node.metadata["n_tokens"] for n in response.source_nodes)
    assert llm.last_stats.cached_tokens == 0 and llm.last_stats.computed_tokens > chunks
    assert llm.last_stats.new_tokens <= NEW


def test_query_engine_settings_are_prompts(store: DocumentStore) -> None:
    engine = PromptCacheQueryEngine.from_store(store, 2, max_new_tokens=NEW)
    template = engine.get_prompts()["qa_template"]
    assert template.template_vars == ["context_str", "query_str"]
    prompt = engine.prompt(QUESTION, engine.retrieve(QUESTION))
    assert prompt.endswith(store.engine.prompt.question_template.format(question=QUESTION))


def test_nodes_without_handles_or_from_another_store_are_refused(store: DocumentStore, tmp_path) -> None:
    engine = PromptCacheQueryEngine.from_store(store, 2, max_new_tokens=NEW)
    plain = TextNode(text="no handle here")
    with pytest.raises(PCRagError, match="carries no prompt-module handle"):
        engine.prompt(QUESTION, [plain])
    other = DocumentStore.create(tmp_path / "other", store.engine, embedder=store.embedder, mode="prefix")
    with pytest.raises(PCRagError, match="comes from store"):
        node_handle(other, engine.retrieve(QUESTION)[0])
    with pytest.raises(PCRagError, match="similarity_top_k"):
        PromptModuleRetriever(store, similarity_top_k=0)


def test_query_engine_needs_an_llm_over_the_retrievers_store(store: DocumentStore, tmp_path) -> None:
    template = module_qa_template(store)
    llm = PromptCacheLLM.from_prompt_cache(PromptCache(store.engine.lm))
    with pytest.raises(PCRagError, match="serves a DocumentStore"):
        PromptCacheQueryEngine(retriever=PromptModuleRetriever(store), llm=llm, qa_template=template)
    other = DocumentStore.create(tmp_path / "other", store.engine, embedder=store.embedder, mode="prefix")
    with pytest.raises(PCRagError, match="the retriever searches store"):
        PromptCacheQueryEngine(
            retriever=PromptModuleRetriever(other), llm=PromptCacheLLM.from_store(store), qa_template=template
        )


def test_empty_store_answers_by_full_prefill(store: DocumentStore, tmp_path) -> None:
    empty = DocumentStore.create(tmp_path / "empty", store.engine, embedder=store.embedder, mode="prefix")
    response = PromptCacheQueryEngine.from_store(empty, 2, max_new_tokens=NEW).query(QUESTION)
    assert response.source_nodes == [] and response.metadata[STATS_KEY]["cached_tokens"] == 0


def test_importing_the_packages_imports_no_framework() -> None:
    code = (
        "import sys, pc_rag.integrations, pc_rag.retrievers\n"
        "assert not [m for m in sys.modules if m.startswith(('llama_index', 'langchain'))]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
