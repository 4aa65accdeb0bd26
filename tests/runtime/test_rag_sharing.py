"""RAG requests share the preamble and the popular chunks they place at the same positions, and answer as alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import tiny_model

from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.runtime.scheduler import Scheduler, _Entry
from pc_rag.runtime.shared_pool import CHUNK_TOKENS
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store import as_embedder
from pc_rag.store.document_store import DocumentStore

DOCS = [
    "The Danube is Europe's second-longest river. It flows into the Black Sea past Vienna and Budapest.",
    "Mount Fuji is the highest mountain of Japan. It is an active volcano, last erupting in 1707.",
]
QUESTIONS = ["Where does the Danube flow?", "Which cities lie on the Danube?", "Is Fuji a volcano?"]


@pytest.fixture(scope="module")
def store(tmp_path_factory, tokenizer) -> DocumentStore:
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    embed = as_embedder(lambda texts: np.ones((len(texts), 8), dtype=np.float32), name="constant")
    store = DocumentStore.create(tmp_path_factory.mktemp("s") / "store", engine, embedder=embed, mode="prefix")
    store.add_documents(DOCS, progress=False)
    return store


def _admitted(store: DocumentStore, mode: str) -> Scheduler:
    """A scheduler (its worker not started) with one admitted request per question, every one retrieving both
    chunks in the same order."""
    scheduler = Scheduler(store.engine.lm)
    server = PromptServer(store=store)
    for question in QUESTIONS:
        _, request, _ = server.rag_request(question, k=2, mode=mode, max_new_tokens=3)
        scheduler._admit(_Entry(request, True))
    return scheduler


def test_requests_retrieving_the_same_chunks_hold_one_copy_of_them(store: DocumentStore) -> None:
    scheduler = _admitted(store, "prefix")
    segments = scheduler._rows[0].segments
    assert len(segments) == 3  # the preamble and both chunks
    assert all(live.segments == segments for live in scheduler._rows)
    held, duplicated = scheduler.kv_bytes()
    per_token = scheduler.pool.chunk_bytes // CHUNK_TOKENS
    assert held == sum(s.chunks for s in segments) * scheduler.pool.chunk_bytes  # one copy, in whole pool chunks
    assert duplicated == len(QUESTIONS) * sum(s.length for s in segments) * per_token
    scheduler.close()


def test_chunks_that_recovery_recomputes_stay_private(store: DocumentStore) -> None:
    scheduler = _admitted(store, "default")
    assert [len(live.segments) for live in scheduler._rows] == [1, 1, 1]  # the preamble only
    scheduler.close()


@pytest.mark.parametrize("mode", ["prefix", "default"])
def test_batched_answers_equal_answers_served_alone(store: DocumentStore, mode: str) -> None:
    alone = [PromptServer(store=store).answer(q, k=2, mode=mode, max_new_tokens=6).text for q in QUESTIONS]
    scheduler = Scheduler(store.engine.lm)
    batched = PromptServer(store=store, scheduler=scheduler)
    try:
        with ThreadPoolExecutor(max_workers=6) as threads:
            together = list(threads.map(lambda q: batched.answer(q, k=2, mode=mode, max_new_tokens=6).text,
                                        QUESTIONS * 2))  # fmt: skip
    finally:
        scheduler.close()
    assert together == alone * 2
