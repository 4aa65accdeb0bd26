"""``pc-rag bench serve``: many requests at once through the scheduler against one at a time, and the attention step.

The workload: one schema whose system turn and modules (bundled sample passages) make ``shared_tokens`` tokens,
and ``concurrency`` prompts that import all of it and add a user turn of 64-128 private tokens, each generating
``new_tokens`` greedily. One at a time is ``PromptCache.generate`` per request, in turn (run on the scheduler's
worker thread, like the batched run); together is every request submitted to a ``Scheduler`` from its own thread
at once. Generated tokens per second of wall time are compared, answers are checked token for token against each
request submitted alone to the scheduler (and against one at a time), and the KV held for the shared part is read
when the most requests were live. ``run_serve_bench`` runs both benchmarks on one scheduler's worker thread.

``attention_benchmark`` times one layer's attention for a decode step: the two-phase partition attention of
``concurrency`` queries sharing ``shared_tokens`` keys against SDPA over the same keys duplicated per query; and,
with no sharing, partition attention of one query against today's single-sequence decode attention. It does so
in two cache states, since on a CPU they rank the same code differently:

- ``flushed``: every call follows a write of ``EVICT_BYTES``, so the data, and also the code and the torch and
  Python state each operation touches, come from memory. This charges every separate torch operation a cost
  that a real step does not pay, and so penalizes the two-phase step (a score of small operations) against
  SDPA's one.
- ``decode-step``: as in a decode step, each call reads its own layer's tensors (one copy per layer of the
  model, taken in turn, too many for the caches) after that layer's weights were read; the code stays warm.

This module knows nothing about HTTP.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pc_rag.engine import PromptCache
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.kv import kv_shape
from pc_rag.pml.nodes import Import, Module, Prompt, Role, Schema, Text
from pc_rag.runtime.decode_step import cache_attention
from pc_rag.runtime.generate import collect
from pc_rag.runtime.partition_attention import (
    SharedRun,
    attend_with_lse,
    partition_attention,
    private_mask,
)
from pc_rag.runtime.scheduler import Scheduler

SYSTEM = "You are a concise assistant. Answer the question from the passages."
EVICT_BYTES = 128 << 20  # written before each timed attention call: several times a server CPU's last-level cache


def asked_together(ask: Callable[[int], list[int]], count: int) -> tuple[list[list[int]], float]:
    """``ask(0)`` ... ``ask(count - 1)`` on ``count`` threads released at once: their results and the wall seconds
    from the release until the last is done."""
    results: list[list[int]] = [[] for _ in range(count)]
    ready = threading.Barrier(count + 1)

    def run(i: int) -> None:
        ready.wait()
        results[i] = ask(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    ready.wait()
    began = time.perf_counter()
    for t in threads:
        t.join()
    return results, time.perf_counter() - began


@dataclass
class ServeResult:
    concurrency: int
    shared_tokens: int
    new_tokens: int
    tokens_per_s: float
    single_tokens_per_s: float
    speedup: float
    identical: bool  # every answer together equals the same request submitted alone to the scheduler
    identical_to_unbatched: bool  # ... and equals it served one at a time without the scheduler (fp32 rounding apart)
    shared_kv_bytes: int
    duplicated_kv_bytes: int
    generated_tokens: int


@dataclass
class AttentionRow:
    caches: str  # "flushed" or "decode-step" (see the module docstring)
    case: str  # "shared" (concurrency queries over shared_tokens keys) or "unshared" (one query)
    queries: int
    keys: int
    partition_us: float
    baseline: str  # "sdpa-duplicated", "decode-duplicated" (today's decode step per query) or "decode"
    baseline_us: float
    speedup: float


def run_serve_bench(
    pc: PromptCache, *, concurrency: int = 16, shared_tokens: int = 1024, new_tokens: int = 32, runs: int = 200
) -> tuple[ServeResult, list[AttentionRow]]:
    """``serve_benchmark`` and ``attention_benchmark``, the scheduler serving on this thread (which loaded the model)
    and every model call made there: one thread drives torch (see ``Scheduler.call``)."""
    scheduler = Scheduler(pc.lm, max_batch=concurrency, shared_tokens=2 * shared_tokens)
    sizes = {"concurrency": concurrency, "shared_tokens": shared_tokens, "runs": runs}

    def both() -> tuple[ServeResult, list[AttentionRow]]:
        result = serve_benchmark(pc, scheduler, shared_tokens=shared_tokens, new_tokens=new_tokens)
        return result, scheduler.call(lambda: attention_benchmark(pc, **sizes))

    return scheduler.run(both)


def serve_benchmark(
    pc: PromptCache, scheduler: Scheduler, *, shared_tokens: int = 1024, new_tokens: int = 32
) -> ServeResult:
    """See the module docstring; ``scheduler.max_batch`` requests at once."""
    concurrency = scheduler.max_batch
    prompts = scheduler.call(lambda: _workload(pc, concurrency, shared_tokens))
    # one at a time, as ``generate`` serves without the scheduler, but on its worker thread: one thread drives
    # torch's CPU threads in both runs (see ``Scheduler.call``)
    scheduler.call(lambda: pc.generate(prompts[0], max_new_tokens=2))  # warm-up: worker thread, first buffers
    began = time.perf_counter()
    alone = [scheduler.call(lambda p=p: pc.generate(p, max_new_tokens=new_tokens)) for p in prompts]
    single_s = time.perf_counter() - began
    # warm-up of the batched paths at full concurrency: every batch size the timed run meets is met here first
    for handle in [scheduler.submit(pc.request(p, max_new_tokens=2)) for p in prompts]:
        collect(handle)
    results, together_s = asked_together(
        lambda i: collect(scheduler.submit(pc.request(prompts[i], max_new_tokens=new_tokens))).token_ids, concurrency
    )
    served_alone = [collect(scheduler.submit(pc.request(p, max_new_tokens=new_tokens))).token_ids for p in prompts]
    generated = sum(len(r.token_ids) for r in alone)
    tokens_per_s, single = generated / together_s, generated / single_s
    return ServeResult(
        concurrency, shared_tokens, new_tokens, tokens_per_s, single, tokens_per_s / single,
        results == served_alone, results == [r.token_ids for r in alone], *scheduler.peak_kv_bytes, generated,
    )  # fmt: skip


def _workload(pc: PromptCache, concurrency: int, shared_tokens: int) -> list[Prompt]:
    """A schema of the system turn and sample passages up to ``shared_tokens`` tokens; prompts importing it all."""
    passages = [f"{title}: {text}" for q in sample_questions() for title, text in q.passages]
    modules, used = [], len(pc.tokenize(SYSTEM))
    while used < shared_tokens:
        text = passages[len(modules)]
        ids = pc.tokenize(text)[: shared_tokens - used]
        modules.append(Module(f"p{len(modules)}", (Text(pc.lm.tokenizer.decode(ids)),)))
        used += len(ids)
    pc.add_schema(Schema("serve-bench", (Role("system", (Text(SYSTEM),)), *modules)))
    questions = [q.question for q in sample_questions()]
    prompts = []
    for i in range(concurrency):
        private = 64 + (64 * i) // max(1, concurrency - 1)  # 64..128 tokens of the user's own
        context = pc.tokenize(passages[-1 - i])
        question = pc.tokenize(f"\nQuestion: {questions[i % len(questions)]}")
        user = pc.lm.tokenizer.decode(context[: max(0, private - len(question))] + question)
        imports = tuple(Import(m.name) for m in modules)
        prompts.append(Prompt("serve-bench", (*imports, Role("user", (Text(user),)))))
    return prompts


def attention_benchmark(
    pc: PromptCache, *, concurrency: int = 16, shared_tokens: int = 1024, private_tokens: int = 128, runs: int = 200
) -> list[AttentionRow]:
    """Median microseconds of one layer's decode attention over ``runs`` calls, in both cache states; see the
    module docstring."""
    decoder = pc.lm.model.get_decoder()
    g = torch.Generator().manual_seed(0)
    sizes = (concurrency, shared_tokens, private_tokens)
    layers = [_contenders(pc, g, *sizes) for _ in decoder.layers]
    weights = [list(layer.parameters()) for layer in decoder.layers]
    with torch.inference_mode():
        flushed = _flushed_medians_us(layers[0], runs)
        decode_step = _decode_step_medians_us(layers, weights, runs)
    keys = shared_tokens + private_tokens
    rows = []
    for caches, (two_phase_us, sdpa_us, each_us, unshared_us, today_us, chunk_us, sequence_us) in (
        ("flushed", flushed), ("decode-step", decode_step)
    ):  # fmt: skip
        rows += [
            AttentionRow(caches, "shared", concurrency, keys, two_phase_us, "sdpa-duplicated", sdpa_us,
                         sdpa_us / two_phase_us),
            AttentionRow(caches, "shared", concurrency, keys, two_phase_us, "decode-duplicated", each_us,
                         each_us / two_phase_us),
            AttentionRow(caches, "chunk-first pass only", concurrency, shared_tokens, chunk_us, "sdpa-duplicated",
                         sdpa_us, sdpa_us / chunk_us),
            AttentionRow(caches, "sequence-first pass only", concurrency, private_tokens, sequence_us,
                         "sdpa-duplicated", sdpa_us, sdpa_us / sequence_us),
            AttentionRow(caches, "unshared", 1, keys, unshared_us, "decode", today_us, today_us / unshared_us),
        ]  # fmt: skip
    return rows


def _contenders(
    pc: PromptCache, g: torch.Generator, concurrency: int, shared_tokens: int, private_tokens: int
) -> list[Callable[[], None]]:
    """One layer's random attention inputs and the calls timed on them: two-phase and SDPA over duplicated KV
    (shared), per-query decode over duplicated KV, two-phase against today's decode for one query (unshared), and
    the two passes of the shared two-phase step each alone (what the step costs before its merge)."""
    _, kv_heads, dim = kv_shape(pc.lm.model)
    heads = pc.lm.model.config.get_text_config().num_attention_heads
    dtype = pc.lm.dtype
    shared = torch.randn(2, kv_heads, shared_tokens, dim, generator=g).to(dtype)
    private = torch.randn(2, concurrency, kv_heads, private_tokens, dim, generator=g).to(dtype)
    query = torch.randn(concurrency, heads, dim, generator=g).to(dtype)
    mask = private_mask(torch.full((concurrency,), private_tokens), private_tokens, dtype)  # built once per step
    scale = dim**-0.5
    run = SharedRun(shared[0], shared[1], torch.arange(concurrency))
    duplicated_k = torch.cat([shared[0].expand(concurrency, -1, -1, -1), private[0]], dim=2)
    duplicated_v = torch.cat([shared[1].expand(concurrency, -1, -1, -1), private[1]], dim=2)

    def two_phase() -> None:
        partition_attention(query, [run], private[0], private[1], mask, scale)

    def sdpa() -> None:
        F.scaled_dot_product_attention(query[:, :, None], duplicated_k, duplicated_v, scale=scale, enable_gqa=True)

    rows_q = query[:, :, None]  # [B, H, 1, D]

    def decode_each() -> None:  # what serving each request on its own does today
        for b in range(concurrency):
            k, v = duplicated_k[b : b + 1], duplicated_v[b : b + 1]
            cache_attention(rows_q[b : b + 1], k, v, scale)

    alone_k = duplicated_k[:1].contiguous()
    alone_v = duplicated_v[:1].contiguous()
    q1 = query[:1, :, None]  # [1, H, 1, D]

    def today() -> None:
        cache_attention(q1, alone_k, alone_v, scale)

    one_mask = private_mask(torch.tensor([alone_k.shape[2]]), alone_k.shape[2], dtype)

    def unshared() -> None:
        partition_attention(query[:1], [], alone_k, alone_v, one_mask, scale)

    grouped = query.view(concurrency, kv_heads, heads // kv_heads, dim)
    every_query = grouped.transpose(0, 1).reshape(1, kv_heads, -1, dim)  # the run's readers: every row

    def chunk_first_pass() -> None:
        attend_with_lse(every_query, shared[0][None], shared[1][None], None, scale)

    def sequence_first() -> None:
        attend_with_lse(grouped, private[0], private[1], mask[:, None, None, :], scale)

    return [two_phase, sdpa, decode_each, unshared, today, chunk_first_pass, sequence_first]


def _flushed_medians_us(contenders: list[Callable[[], None]], runs: int) -> list[float]:
    """Median microseconds of each contender, timed in turn within every round (after one warm-up round), so the
    machine's drift falls on all of them alike; every call follows a write of ``EVICT_BYTES``. Without it, a
    contender whose tensors another contender just read (SDPA's duplicated KV and the per-request decode share
    them) would run warm and the others cold."""
    evict = torch.zeros(EVICT_BYTES // 4)
    times: list[list[float]] = [[] for _ in contenders]
    for round_ in range(runs + 1):
        for run, spent in zip(contenders, times, strict=True):
            evict.add_(1.0)
            began = time.perf_counter()
            run()
            if round_:
                spent.append(time.perf_counter() - began)
    return [1e6 * statistics.median(spent) for spent in times]


def _decode_step_medians_us(
    layers: list[list[Callable[[], None]]], weights: list[list[torch.Tensor]], runs: int
) -> list[float]:
    """Median microseconds of each contender over about ``runs`` calls: in every round (after one warm-up round),
    each contender in turn is called on every layer's inputs in order, each call after reading that layer's
    weights, as a decode step does."""
    rounds = -(-runs // len(layers))
    times: list[list[float]] = [[] for _ in layers[0]]
    for round_ in range(rounds + 1):
        for index, spent in enumerate(times):
            for contenders, layer_weights in zip(layers, weights, strict=True):
                for weight in layer_weights:
                    weight.sum()
                began = time.perf_counter()
                contenders[index]()
                if round_:
                    spent.append(time.perf_counter() - began)
    return [1e6 * statistics.median(spent) for spent in times]


def format_serve(result: ServeResult) -> str:
    r = result
    saved = 1 - r.shared_kv_bytes / r.duplicated_kv_bytes if r.duplicated_kv_bytes else 0.0
    return (
        f"{r.concurrency} requests, {r.shared_tokens} shared tokens, {r.new_tokens} new tokens each\n"
        f"one at a time: {r.single_tokens_per_s:,.1f} tokens/s   together: {r.tokens_per_s:,.1f} tokens/s   "
        f"({r.speedup:.2f}x)\n"
        f"identical answers: {r.identical} (to one at a time: {r.identical_to_unbatched})\n"
        f"shared KV held: {r.shared_kv_bytes / 2**20:,.1f} MiB, duplicated: {r.duplicated_kv_bytes / 2**20:,.1f} MiB "
        f"({saved:.0%} less)"
    )


def format_attention(rows: list[AttentionRow]) -> str:
    lines = [
        f"{'caches':<11} {'case':<9} {'queries':>7} {'keys':>6} {'two-phase us':>12} {'baseline':<18} "
        f"{'baseline us':>11} {'speedup':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r.caches:<11} {r.case:<9} {r.queries:>7} {r.keys:>6} {r.partition_us:>12,.1f} {r.baseline:<18} "
            f"{r.baseline_us:>11,.1f} {r.speedup:>7.2f}x"
        )
    return "\n".join(lines)
