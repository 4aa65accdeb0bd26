"""Continuous batching answers every request exactly as serving it alone does, shares KV, and refuses overload."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import tiny_model

from pc_rag.engine import PromptCache
from pc_rag.errors import ContextLengthError, PCRagError, ServerBusyError
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.runtime.generate import collect
from pc_rag.runtime.scheduler import Scheduler
from pc_rag.runtime.shared_pool import CHUNK_TOKENS
from pc_rag.runtime.submission import Entry

SCHEMA = """<schema name="s"><system>You answer questions about cities and rivers.</system>
<module name="facts">Paris lies on the Seine. The Danube ends in the Black Sea. Fuji is a volcano in Japan.</module>
<module name="extra">Vienna and Budapest lie on the Danube.</module></schema>"""
QUESTIONS = ["Where does the Danube end?", "Which river flows through Paris?", "Is Fuji a volcano?",
             "Name two Danube cities.", "What is the Seine?", "Where is Fuji?"]  # fmt: skip


def _prompt(question: str, extra: bool) -> str:
    imports = "<facts/><extra/>" if extra else "<facts/>"
    return f'<prompt schema="s">{imports}<user>{question}</user></prompt>'


@pytest.fixture(scope="module", params=["llama", "gemma3"])  # gemma3: a model the batched step does not describe
def cache(request, tokenizer) -> PromptCache:
    pc = PromptCache(tiny_model(request.param, tokenizer))
    pc.add_schema(SCHEMA)
    return pc


def _alone(pc: PromptCache, prompt: str, **kwargs) -> list[int]:
    return pc.generate(prompt, **kwargs).token_ids


def _together(scheduler: Scheduler, pc: PromptCache, prompts: list[str], threads: int, **kwargs) -> list[list[int]]:
    """The token ids of ``prompts`` submitted at once from ``threads`` threads; the scheduler is closed after."""
    try:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            return list(pool.map(lambda p: collect(scheduler.submit(pc.request(p, **kwargs))).token_ids, prompts))
    finally:
        scheduler.close()


def test_concurrent_requests_answer_exactly_as_served_alone(cache: PromptCache) -> None:
    prompts = [_prompt(q, i % 2 == 0) for i, q in enumerate(QUESTIONS)] * 3
    alone = [_alone(cache, p, max_new_tokens=12) for p in prompts]
    assert _together(Scheduler(cache.lm, max_batch=5), cache, prompts, 8, max_new_tokens=12) == alone


def test_a_pool_too_small_for_the_live_requests_grows_and_keeps_their_answers(tokenizer) -> None:
    """A pool of one chunk cannot hold the system turn and two modules: it grows while they are live (a part that
    found no room used to stay private in every request's arena row), and the answers stay those served alone."""
    pc = PromptCache(tiny_model("llama", tokenizer))
    pc.add_schema(SCHEMA)
    prompts = [_prompt(q, True) for q in QUESTIONS[:4]]
    alone = [_alone(pc, p, max_new_tokens=6) for p in prompts]
    scheduler = Scheduler(pc.lm, max_batch=4, shared_tokens=CHUNK_TOKENS)
    assert scheduler.pool.chunks == 1
    assert _together(scheduler, pc, prompts, 4, max_new_tokens=6) == alone
    assert scheduler.pool.chunks >= 3 and scheduler.served["batched"] == 4
    assert scheduler.peak_kv_bytes[0] > 0  # the parts were shared, not left private


def test_sampled_requests_follow_their_seed(cache: PromptCache) -> None:
    settings = {"max_new_tokens": 8, "temperature": 0.9, "top_k": 40, "seed": 7}
    alone = _alone(cache, _prompt(QUESTIONS[0], True), **settings)
    scheduler = Scheduler(cache.lm)
    try:
        streams = [scheduler.submit(cache.request(_prompt(q, True), **settings)) for q in QUESTIONS[:1] * 3]
        assert [collect(s).token_ids for s in streams] == [alone] * 3
    finally:
        scheduler.close()


def test_live_requests_share_one_copy_of_their_common_modules(tokenizer) -> None:
    pc = PromptCache(tiny_model("llama", tokenizer))
    pc.add_schema(SCHEMA)
    scheduler = Scheduler(pc.lm)  # its worker is not started: the test admits and steps by hand
    entries = [Entry(pc.request(_prompt(q, True), max_new_tokens=4), True) for q in QUESTIONS[:4]]
    for entry in entries:
        scheduler._admit(entry)
    held, duplicated = scheduler.kv_bytes()
    segments = scheduler._rows[0].segments
    assert len(segments) == 3 and all(live.segments == segments for live in scheduler._rows)  # system, 2 modules
    per_token = scheduler.pool.chunk_bytes // CHUNK_TOKENS
    assert held == sum(s.chunks for s in segments) * scheduler.pool.chunk_bytes  # stored once, in whole chunks
    assert duplicated == 4 * sum(s.length for s in segments) * per_token > held
    while scheduler._rows:
        scheduler._step_batch()
    assert scheduler.kv_bytes() == (0, 0)  # released, still cached for the next request that imports them


def test_a_stop_string_ends_the_request_early(cache: PromptCache) -> None:
    full = cache.generate(_prompt(QUESTIONS[1], False), max_new_tokens=16)
    assert len(full.text) > 4
    stop = full.text[2:4]
    scheduler = Scheduler(cache.lm)
    try:
        result = collect(scheduler.submit(cache.request(_prompt(QUESTIONS[1], False), max_new_tokens=16, stop=(stop,))))
    finally:
        scheduler.close()
    assert full.text.startswith(result.text) and stop not in result.text


def test_a_failing_request_fails_alone(tokenizer) -> None:
    engine = RagEngine(tiny_model("llama", tokenizer), RagPrompt())
    chunks = engine.encode(["The Danube ends in the Black Sea."], "prefix")
    scheduler = Scheduler(engine.lm)
    try:
        too_long = scheduler.submit(engine.request(chunks, "x " * 5000, "prefix"))
        fine = scheduler.submit(engine.request(chunks, "Where does the Danube end?", "prefix", max_new_tokens=4))
        with pytest.raises(ContextLengthError):
            collect(too_long)
        alone = engine.answer(chunks, "Where does the Danube end?", "prefix", max_new_tokens=4)
        assert collect(fine).token_ids == alone.token_ids
    finally:
        scheduler.close()


def test_overload_is_refused_and_closing_fails_what_waits(tokenizer, monkeypatch) -> None:
    pc = PromptCache(tiny_model("llama", tokenizer))
    pc.add_schema(SCHEMA)
    scheduler = Scheduler(pc.lm, queue_limit=2)
    monkeypatch.setattr(scheduler, "_run", lambda: None)  # a worker that never admits: requests wait
    waiting = [scheduler.submit(pc.request(_prompt(q, False))) for q in QUESTIONS[:2]]
    with pytest.raises(ServerBusyError, match="queue limit 2"):
        scheduler.submit(pc.request(_prompt(QUESTIONS[2], False)))
    scheduler._fail_all(PCRagError("the scheduler is closed"))
    for stream in waiting:
        with pytest.raises(PCRagError, match="closed"):
            collect(stream)
