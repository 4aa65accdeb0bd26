"""RAG requests share the preamble and the popular chunks they place at the same positions, decode together in
every mode that calls the model without attention kwargs (the default ``fast`` applies a splice adapter), and
answer as alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import acting_adapter, tiny_model
from test_weights import tiny_in

from pc_rag.calibration import Calibration
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.runtime.generate import collect
from pc_rag.runtime.scheduler import Scheduler
from pc_rag.runtime.shared_pool import CHUNK_TOKENS
from pc_rag.runtime.submission import Entry
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


@pytest.fixture(scope="module", params=["merged", "hooks", "int4 merged"])
def adapted(request, tmp_path_factory, tokenizer) -> DocumentStore:
    """A store whose engine serves a splice adapter (merged, as a trained one is served, or as training's hooks;
    on float32 weights, or on int4 ones whose fused kernels it must not be bypassed by) and a calibration."""
    lm = tiny_in("llama", "int4", tokenizer) if request.param.startswith("int4") else tiny_model("llama", tokenizer)
    adapter = acting_adapter(lm.model)
    adapter.attach(merged=request.param.endswith("merged"))
    engine = RagEngine(lm, RagPrompt(), adapter=adapter, calibration=Calibration(0.8, 1.2))
    embed = as_embedder(lambda texts: np.ones((len(texts), 8), dtype=np.float32), name="constant")
    store = DocumentStore.create(tmp_path_factory.mktemp("a") / "store", engine, embedder=embed, mode="fast")
    store.add_documents(DOCS, progress=False)
    return store


def _together(store: DocumentStore, modes: list[str], max_new_tokens: int = 6) -> tuple[list[list[int]], Scheduler]:
    """Every question in each of ``modes`` submitted at once (admitted in one round) and answered by the scheduler."""
    server = PromptServer(store=store)
    requests = [server.rag_request(q, k=2, mode=m, max_new_tokens=max_new_tokens)[1] for m in modes for q in QUESTIONS]
    scheduler = Scheduler(store.engine.lm)
    try:
        handles = scheduler.call(lambda: [scheduler.submit(r) for r in requests])  # all waiting at the next round
        return [collect(h).token_ids for h in handles], scheduler
    finally:
        scheduler.close()


def _alone_in_scheduler(store: DocumentStore, modes: list[str], max_new_tokens: int = 6) -> list[list[int]]:
    """Each question in each of ``modes`` submitted to the scheduler after the previous one has finished."""
    server = PromptServer(store=store)
    scheduler = Scheduler(store.engine.lm)
    try:
        return [
            collect(scheduler.submit(server.rag_request(q, k=2, mode=m, max_new_tokens=max_new_tokens)[1])).token_ids
            for m in modes
            for q in QUESTIONS
        ]
    finally:
        scheduler.close()


def _alone(store: DocumentStore, mode: str, max_new_tokens: int = 6) -> list[list[int]]:
    server = PromptServer(store=store)
    return [server.answer(q, k=2, mode=mode, max_new_tokens=max_new_tokens).result.token_ids for q in QUESTIONS]


@pytest.mark.parametrize("mode", ["fast", "naive", "selective", "edge", "selective+adapter"])
def test_the_default_and_recovery_modes_decode_in_one_batch_as_alone(adapted: DocumentStore, mode: str) -> None:
    together, scheduler = _together(adapted, [mode])
    assert scheduler.served == {"batched": len(QUESTIONS)}  # none served alone
    assert scheduler.widest_step == len(QUESTIONS)  # every request in one step
    assert together == _alone_in_scheduler(adapted, [mode])
    if rounds_alike(adapted):
        assert together == _alone(adapted, mode)


def rounds_alike(store: DocumentStore) -> bool:
    """Whether answers together equal answers served without the scheduler bit for bit: not in int4, where that
    path's attention (``decode_attention``, the model's own prefill) rounds its bfloat16 differently; served one at
    a time by the scheduler, they are equal in every dtype (``_alone_in_scheduler``)."""
    return store.engine.lm.compute is None or store.engine.lm.compute.linear is None


def test_the_adapter_changes_the_answers(adapted: DocumentStore) -> None:
    """Else the test above would not tell an adapted step from a plain one."""
    assert _alone(adapted, "fast") != _alone(adapted, "prefix")


def test_requests_under_different_adapters_decode_in_steps_of_their_own(adapted: DocumentStore) -> None:
    together, scheduler = _together(adapted, ["prefix", "fast", "prefix+adapter"])
    assert scheduler.served == {"batched": 3 * len(QUESTIONS)}
    assert scheduler.widest_step == 2 * len(QUESTIONS)  # fast and prefix+adapter: one adapter, one context
    assert together == _alone_in_scheduler(adapted, ["prefix", "fast", "prefix+adapter"])
    if rounds_alike(adapted):
        assert together == _alone(adapted, "prefix") + _alone(adapted, "fast") + _alone(adapted, "prefix+adapter")


def test_calibrated_attention_is_served_alone_as_before(adapted: DocumentStore) -> None:
    """Calibration rescales attention to chunk keys through an attention kwarg the batched step does not take."""
    together, scheduler = _together(adapted, ["prefix+ape"])
    assert scheduler.served == {"alone": len(QUESTIONS)}
    assert together == _alone(adapted, "prefix+ape")


def _admitted(store: DocumentStore, mode: str) -> Scheduler:
    """A scheduler (its worker not started) with one admitted request per question, every one retrieving both
    chunks in the same order."""
    scheduler = Scheduler(store.engine.lm)
    server = PromptServer(store=store)
    for question in QUESTIONS:
        _, request, _ = server.rag_request(question, k=2, mode=mode, max_new_tokens=3)
        scheduler._admit(Entry(request, True))
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
