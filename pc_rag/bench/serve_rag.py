"""``pc-rag bench serve --store DIR``: ``+rag`` answers from a store, many at once through the scheduler against one
at a time, in the store's recovery mode (its default, ``fast``, applies the splice adapter) or another.

The workload: ``concurrency`` questions (the bundled sample questions, repeated), each retrieving ``k`` chunks and
generating ``new_tokens`` greedily, as the HTTP server's ``<model>+rag`` answers them (``PromptServer.answer``).
One at a time is each answered without the scheduler, in turn, on the scheduler's worker thread (one thread
drives torch in both runs, see ``Scheduler.call``); together is every question asked at once from its own
thread of a ``PromptServer`` on the scheduler. Both runs include retrieval and building each request. Answers are
compared token for token, and the scheduler's counts say how many requests were batched and how many served
alone, and the most rows one decode step ran. This module knows nothing about HTTP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pc_rag.bench.serve import asked_together
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.runtime.scheduler import Scheduler
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore


@dataclass
class RagServeResult:
    concurrency: int
    mode: str
    k: int
    new_tokens: int
    tokens_per_s: float  # together
    single_tokens_per_s: float  # one at a time
    speedup: float
    identical: bool  # every answer together has the token ids of the same question answered one at a time
    batched: int  # requests of the timed run the scheduler decoded in its batch
    alone: int  # ... and those it served alone (a mode the batched step cannot run)
    widest_step: int  # the most rows one batched decode step ran
    generated_tokens: int


def run_rag_serve_bench(
    store: DocumentStore, *, concurrency: int = 32, k: int = 3, mode: str | None = None, new_tokens: int = 32
) -> RagServeResult:
    """``rag_serve_benchmark`` with the scheduler serving on this thread (the one that loaded the model)."""
    scheduler = Scheduler(store.engine.lm, max_batch=concurrency)
    return scheduler.run(lambda: rag_serve_benchmark(store, scheduler, k=k, mode=mode, new_tokens=new_tokens))


def rag_serve_benchmark(
    store: DocumentStore, scheduler: Scheduler, *, k: int = 3, mode: str | None = None, new_tokens: int = 32
) -> RagServeResult:
    """See the module docstring; ``scheduler.max_batch`` questions at once, in ``mode`` (default: the store's)."""
    concurrency = scheduler.max_batch
    sample = [q.question for q in sample_questions()]
    questions = [sample[i % len(sample)] for i in range(concurrency)]
    mode = mode or store.mode
    unscheduled = PromptServer(store=store, mode=mode)
    scheduled = PromptServer(store=store, mode=mode, scheduler=scheduler)
    scheduler.call(lambda: unscheduled.answer(questions[0], k=k, max_new_tokens=2))  # warm-up: adapter, buffers
    began = time.perf_counter()
    alone = [
        scheduler.call(lambda q=q: unscheduled.answer(q, k=k, max_new_tokens=new_tokens)).result.token_ids
        for q in questions
    ]
    single_s = time.perf_counter() - began
    asked_together(  # warm-up of the batched paths at full concurrency
        lambda i: scheduled.answer(questions[i], k=k, max_new_tokens=2).result.token_ids, concurrency
    )
    served, scheduler.widest_step = dict(scheduler.served), 0
    results, together_s = asked_together(
        lambda i: scheduled.answer(questions[i], k=k, max_new_tokens=new_tokens).result.token_ids, concurrency
    )
    generated = sum(len(ids) for ids in alone)
    tokens_per_s, single = generated / together_s, generated / single_s
    batched = scheduler.served["batched"] - served.get("batched", 0)
    return RagServeResult(
        concurrency, mode, k, new_tokens, tokens_per_s, single, tokens_per_s / single, results == alone, batched,
        scheduler.served["alone"] - served.get("alone", 0), scheduler.widest_step, generated,
    )  # fmt: skip


def format_rag_serve(result: RagServeResult) -> str:
    r = result
    return (
        f"{r.concurrency} +rag requests, mode {r.mode}, k={r.k}, {r.new_tokens} new tokens each\n"
        f"one at a time: {r.single_tokens_per_s:,.1f} tokens/s   together: {r.tokens_per_s:,.1f} tokens/s   "
        f"({r.speedup:.2f}x)\n"
        f"identical answers: {r.identical}   batched: {r.batched}, served alone: {r.alone}, "
        f"widest decode step: {r.widest_step} rows"
    )
