"""The LangChain chain on SmolLM2 over bundled HotpotQA passages: it answers exactly like the store, streamed or not."""

from __future__ import annotations

import pytest
from langchain_core.runnables import RunnablePassthrough

from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.integrations.langchain import PromptCacheLLM, PromptModuleRetriever, format_modules, module_prompt_template
from pc_rag.model import LoadedModel
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def store(tmp_path_factory, smollm2: LoadedModel) -> DocumentStore:
    store = DocumentStore.create(
        tmp_path_factory.mktemp("lc-real") / "store", RagEngine(smollm2, RagPrompt.longbench())
    )
    passages = {f"{t}\n{x}": {"title": t} for t, x in sample_questions()[0].passages[:6]}
    store.add_documents(list(passages.items()), progress=False)
    return store


def test_chain_answers_like_the_store_streamed_or_not(store: DocumentStore) -> None:
    question = sample_questions()[0].question
    llm = PromptCacheLLM.from_store(store, max_tokens=8)
    chain = (
        {"context": PromptModuleRetriever(store=store, k=2) | format_modules, "question": RunnablePassthrough()}
        | module_prompt_template(store)
        | llm
    )
    answer = chain.invoke(question)
    direct = PromptServer(store=store).answer(question, k=2, max_new_tokens=8)
    assert answer == direct.text and answer.strip()
    assert (
        llm.last_stats.cached_tokens == direct.result.stats.cached_tokens > sum(h.n_tokens for h in direct.sources) // 2
    )
    assert "".join(chain.stream(question)) == answer
