"""The LlamaIndex adapter on SmolLM2 with MiniLM retrieval: cached answers equal the store's, and both paths answer.

One HotpotQA sample question, its ten passages as the store. The query engine
splices the retrieved modules; LlamaIndex's stock engine reads the same chunks
as text by full prefill. Both find the answer; timing is not asserted (shared CPUs).
"""

from __future__ import annotations

import pytest
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.query_engine import RetrieverQueryEngine

from pc_rag.cli.store_commands import engine_for
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.integrations.llama_index import PromptCacheQueryEngine
from pc_rag.integrations.llama_index_query import STATS_KEY
from pc_rag.model import LoadedModel
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore

pytestmark = pytest.mark.real_model

QUESTION = sample_questions()[5]  # the actor of "Arrival" nominated for "The Town": Jeremy Renner


@pytest.fixture(scope="module")
def query_engine(smollm2: LoadedModel, tmp_path_factory) -> PromptCacheQueryEngine:
    # the recompute mode this check was written for: on this one question `fast`, the default since, answers
    # without the name in 16 tokens (the default is chosen on the 554 dev questions, not on one)
    directory = tmp_path_factory.mktemp("li-real") / "store"
    store = DocumentStore.create(directory, engine_for(smollm2), mode="default")  # MiniLM embeddings
    store.add_documents([(f"{title}\n{text}", {"title": title}) for title, text in QUESTION.passages], progress=False)
    return PromptCacheQueryEngine.from_store(store, 3, max_new_tokens=16)


def test_cached_answer_is_the_store_answer_and_finds_the_entity(query_engine: PromptCacheQueryEngine) -> None:
    response = query_engine.query(QUESTION.question)
    native = PromptServer(store=query_engine.store).answer(QUESTION.question, k=3, max_new_tokens=16)
    assert response.response == native.text and QUESTION.answers[0] in response.response
    stats = response.metadata[STATS_KEY]
    assert stats["cached_tokens"] > 2 * stats["computed_tokens"]
    assert any(n.node.metadata["title"] == "Jeremy Renner" for n in response.source_nodes)


def test_stock_engine_reads_the_chunks_as_text(query_engine: PromptCacheQueryEngine) -> None:
    llm = query_engine.llm
    stock = RetrieverQueryEngine.from_args(query_engine.retriever, llm=llm)
    response = stock.query(QUESTION.question)
    assert QUESTION.answers[0] in response.response
    assert llm.last_stats.cached_tokens == 0 and llm.last_stats.computed_tokens > 300


def test_chat_answers_through_the_chat_template(query_engine: PromptCacheQueryEngine) -> None:
    reply = query_engine.llm.chat([ChatMessage(content="What is the capital of France?")], max_new_tokens=12)
    assert "Paris" in reply.message.content
