"""Concurrent answers equal serial ones: the recovery probes change nothing of the shared model."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import tiny_model
from test_document_store import DOCS, embedder

from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore

QUESTIONS = [
    "Which city has the tower?", "What is the highest mountain?", "Where does the Danube end?",
    "When was the tower finished?", "Is Fuji a volcano?", "Which river is second-longest?",
    "What is the tower made of?", "Which sea does the river reach?", "Where is Mount Fuji?",
    "How old is the tower?",
]  # fmt: skip


@pytest.mark.parametrize("mode", ["default", "blend:0.3", "query:0.3"])
def test_eight_threads_answer_as_one_does(tmp_path, tokenizer, mode: str) -> None:
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    store = DocumentStore.create(tmp_path / "store", engine, embedder=embedder(), chunk_tokens=24, overlap_tokens=4)
    store.add_documents(DOCS, ids=["eiffel", "fuji", "danube"], progress=False)
    layers = len(engine.lm.model.get_decoder().layers)

    def ask(question: str) -> list[int]:
        return PromptServer(store=store).answer(question, k=3, mode=mode, max_new_tokens=6).result.token_ids

    serial = [ask(q) for q in QUESTIONS]
    with ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(ask, QUESTIONS * 8))
    assert concurrent == serial * 8
    assert len(engine.lm.model.get_decoder().layers) == layers  # the shared model is as it was


def test_langchain_ainvoke_and_abatch_answer_as_serial_calls_do(tmp_path, tokenizer) -> None:
    """LangChain runs ``ainvoke`` and ``abatch`` in executor threads: default mode must survive them."""
    import asyncio

    from pc_rag.integrations.langchain import PromptCacheLLM

    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    store = DocumentStore.create(tmp_path / "store", engine, embedder=embedder(), chunk_tokens=24, overlap_tokens=4)
    store.add_documents(DOCS, ids=["eiffel", "fuji", "danube"], progress=False)
    llm = PromptCacheLLM.from_store(store, mode="default", max_tokens=6)
    refs = ["".join(store.module_ref(h) for h in store.search(q, k=3)) for q in QUESTIONS]
    prompts = [f"{engine.prompt.preamble}{r}\n{q}" for r, q in zip(refs, QUESTIONS, strict=True)]
    serial = [llm.invoke(p) for p in prompts]

    async def together() -> tuple[list[str], list[str]]:
        gathered = await asyncio.gather(*(llm.ainvoke(p) for p in prompts * 4))
        return list(gathered), await llm.abatch(prompts * 4, config={"max_concurrency": 8})

    gathered, batched = asyncio.run(together())
    assert gathered == serial * 4 and batched == serial * 4
