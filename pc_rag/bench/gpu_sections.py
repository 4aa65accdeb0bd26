"""The sections of ``pc-rag bench gpu``: each times one workload on the bench's model and appends its gates
(``SECTIONS``: name -> body and the gates it owns). This module knows nothing about HTTP or stores."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from pc_rag.bench.gpu_harness import Gate, GpuBench
from pc_rag.runtime.model_call import with_cache


def ttft_prompt_cache(bench: GpuBench) -> list[dict[str, Any]]:
    """Prompt Cache: a schema of passage modules, cached (splice + question) against full prefill of the same
    tokens; then the same with the module KV in pinned host memory, copied per request (no gate)."""
    from pc_rag.engine import PromptCache

    pc = PromptCache(bench.lm)
    rows = []
    for label, target in (("2k", 2048), ("8k", 8192), ("32k", 32768)):
        name, prompt = _passages_prompt(pc, bench.tokens(target))
        ids = pc.full_prompt_ids(prompt)
        full = bench.median_ms(lambda ids=ids: pc.generate_ids(ids, max_new_tokens=1).stats.ttft_ms)
        cached = bench.median_ms(lambda p=prompt: pc.generate(p, max_new_tokens=1).stats.ttft_ms)
        encoded = pc.schemas[name]
        on_device = encoded.kv
        encoded.kv = {k: v.to("cpu") for k, v in on_device.items()}  # pinned where CUDA is available
        host = bench.median_ms(lambda p=prompt: pc.generate(p, max_new_tokens=1).stats.ttft_ms)
        encoded.kv = on_device
        rows.append({"label": label, "context": len(ids), "full_ms": round(full, 2), "cached_ms": round(cached, 2),
                     "speedup": round(full / cached, 2), "cached_from_host_ms": round(host, 2)})  # fmt: skip
        bench.on_progress(f"   {rows[-1]}")
        del pc.schemas[name]
    by = {r["label"]: r for r in rows}
    bench.gates += [
        Gate("prompt_cache_speedup_2k", by["2k"]["speedup"], 3),
        Gate("prompt_cache_speedup_8k", by["8k"]["speedup"], 10),
        Gate("prompt_cache_speedup_32k", by["32k"]["speedup"], 40),
        Gate("prompt_cache_cached_ttft_2k_ms", by["2k"]["cached_ms"], 10, at_least=False, unit="ms"),
    ]
    return rows


def _passages_prompt(pc: Any, tokens: int) -> tuple[str, Any]:
    """A schema of passage modules making about ``tokens`` tokens, registered in ``pc``, and a prompt importing
    all of them with the benchmark question (``bench ttft``'s workload)."""
    from pc_rag.bench.ttft import QUESTION, _build_schema
    from pc_rag.pml.builder import PromptBuilder

    name, modules = _build_schema(pc, tokens)
    builder = PromptBuilder(name)
    for module in modules:
        builder.use(module)
    return name, builder.user(QUESTION).build()


RAG_MODES = {"prefix": "prefix", "default": "selective:0.25"}
"""The gated RAG modes: ``default`` is the recompute mode the gates were set for (25% by value deviation)."""


def rag_modes(bench: GpuBench) -> list[dict[str, Any]]:
    """RAG modes on the bundled sample passages: one question's passages (~1.3K tokens) and six questions' (~8K)."""
    from pc_rag.hotpotqa_sample import sample_questions
    from pc_rag.rag.engine import RagEngine

    engine = RagEngine(bench.lm)
    questions = sample_questions()
    rows = []
    for label, per_question in (("1.3k", 1), ("8k", 6)):
        texts: list[str] = []
        for j in range(per_question):
            for title, text in questions[j % len(questions)].passages:
                texts.append(engine.passage_text(len(texts) + 1, title, text))
        if bench.shape.scale > 1:
            texts = texts[: max(1, len(texts) // bench.shape.scale)]
        question = questions[0].question
        chunks = {mode: engine.encode(texts, spec) for mode, spec in RAG_MODES.items()}
        first = chunks["prefix"]
        full = bench.median_ms(lambda c=first, q=question: engine.answer_full(c, q, max_new_tokens=1).stats.ttft_ms)
        context = len(engine.full_ids(first, question))
        row: dict[str, Any] = {"label": label, "context": context, "full_ms": round(full, 2)}
        for mode, spec in RAG_MODES.items():
            ms = bench.median_ms(partial(_answer_ms, engine, chunks[mode], question, spec))
            row[f"{mode}_ms"], row[f"{mode}_speedup"] = round(ms, 2), round(full / ms, 2)
        rows.append(row)
        bench.on_progress(f"   {row}")
    by = {r["label"]: r for r in rows}
    bench.gates += [
        Gate("rag_prefix_speedup_1.3k", by["1.3k"]["prefix_speedup"], 3),
        Gate("rag_prefix_speedup_8k", by["8k"]["prefix_speedup"], 10),
        Gate("rag_default_speedup_1.3k", by["1.3k"]["default_speedup"], 2.5),
        Gate("rag_default_speedup_8k", by["8k"]["default_speedup"], 3),
    ]
    return rows


def _answer_ms(engine: Any, chunks: Any, question: str, mode: str) -> float:
    return engine.answer(chunks, question, mode, max_new_tokens=1).stats.ttft_ms


def decode_speed(bench: GpuBench, new_tokens: int = 64) -> list[dict[str, Any]]:
    """Single-stream decode tokens/s after a cached prompt and after full prefill of the same tokens."""
    from pc_rag.engine import PromptCache
    from pc_rag.runtime.generate import GenerationResult

    def per_s(result: GenerationResult) -> float:
        stats = result.stats
        return (stats.new_tokens - 1) / ((stats.total_ms - stats.ttft_ms) / 1000) if stats.new_tokens > 1 else 0.0

    pc = PromptCache(bench.lm)
    rows = []
    for label, target in (("1k", 1024), ("8k", 8192)):
        name, prompt = _passages_prompt(pc, bench.tokens(target))
        ids = pc.full_prompt_ids(prompt)
        # warm-up at the timed length: the same buffers (sized for the reply), so no capture lands in a timed run
        pc.generate(prompt, max_new_tokens=new_tokens)
        pc.generate_ids(ids, max_new_tokens=new_tokens)
        cached = statistics.median(per_s(pc.generate(prompt, max_new_tokens=new_tokens)) for _ in range(bench.runs))
        full = statistics.median(per_s(pc.generate_ids(ids, max_new_tokens=new_tokens)) for _ in range(bench.runs))
        rows.append({"label": label, "context": len(ids), "cached_tokens_per_s": round(cached, 1),
                     "full_tokens_per_s": round(full, 1)})  # fmt: skip
        bench.on_progress(f"   {rows[-1]}")
        del pc.schemas[name]
    by = {r["label"]: r for r in rows}
    slowest = min(r["full_tokens_per_s"] / r["cached_tokens_per_s"] for r in rows)
    bench.gates += [
        Gate("decode_tokens_per_s_1k", by["1k"]["cached_tokens_per_s"], 200, unit="tok/s"),
        Gate("decode_tokens_per_s_8k", by["8k"]["cached_tokens_per_s"], 150, unit="tok/s"),
        # "no slower", within 5% run-to-run noise
        Gate("full_prefill_decode_vs_cached", round(slowest, 3), 0.95),
    ]
    return rows


def attention_two_phase(bench: GpuBench) -> list[dict[str, Any]]:
    """One layer's decode-step attention: two-phase partition attention against SDPA over duplicated KV; and the
    capturable split-KV form (``StaticBatchStep``'s), replayed as a CUDA graph on CUDA (no gate yet)."""
    import torch.nn.functional as F

    from pc_rag.runtime.partition_attention import SharedRun, partition_attention, private_mask
    from pc_rag.runtime.static_batch_step import split_kv_attention

    config = bench.lm.model.config
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, bench.shape.head_dim
    dtype, device, scale = bench.lm.dtype, bench.device, bench.shape.scale
    rows = []
    for label, batch, shared_len, private_len in (("16x1k", 16, 1024, 128), ("64x8k", 64, 8192, 256)):
        batch, shared_len = max(2, batch // scale), max(64, shared_len // scale)
        private_len = max(8, private_len // scale)
        g = torch.Generator(device=device).manual_seed(0)
        shared = torch.randn(2, kv_heads, shared_len, dim, generator=g, device=device).to(dtype)
        private = torch.randn(2, batch, kv_heads, private_len, dim, generator=g, device=device).to(dtype)
        q = torch.randn(batch, heads, dim, generator=g, device=device).to(dtype)
        mask = private_mask(torch.full((batch,), private_len, device=device), private_len, dtype)
        runs = [SharedRun(shared[0], shared[1], torch.arange(batch, device=device))]
        dup_k = torch.cat([shared[0].expand(batch, -1, -1, -1), private[0]], 2).contiguous()
        dup_v = torch.cat([shared[1].expand(batch, -1, -1, -1), private[1]], 2).contiguous()
        two_phase = partial(partition_attention, q, runs, private[0], private[1], mask, dim**-0.5)
        sdpa = partial(F.scaled_dot_product_attention, q[:, :, None], dup_k, dup_v, scale=dim**-0.5, enable_gqa=True)
        split_kv = partial(split_kv_attention, q, shared[0], shared[1],
                           torch.ones(batch, shared_len, dtype=torch.bool, device=device), private[0], private[1],
                           torch.ones(batch, private_len, dtype=torch.bool, device=device), dim**-0.5)  # fmt: skip
        reference = sdpa()[:, :, 0].float()
        error = float((two_phase().float() - reference).abs().max())
        split_error = float((split_kv().float() - reference).abs().max())
        us = {name: _time_us(bench, fn) for name, fn in (("two_phase", two_phase), ("sdpa_dup", sdpa),
                                                          ("split_kv", _graphed(bench, split_kv)))}  # fmt: skip
        rows.append({"label": label, "batch": batch, "shared": shared_len, "private": private_len,
                     "two_phase_us": round(us["two_phase"], 1), "sdpa_dup_us": round(us["sdpa_dup"], 1),
                     "speedup": round(us["sdpa_dup"] / us["two_phase"], 2), "max_abs_err": error,
                     "split_kv_graphed_us": round(us["split_kv"], 1),
                     "split_kv_graphed": bench.device.startswith("cuda"),
                     "split_kv_speedup": round(us["sdpa_dup"] / us["split_kv"], 2),
                     "split_kv_max_abs_err": split_error})  # fmt: skip
        bench.on_progress(f"   {rows[-1]}")
    by = {r["label"]: r for r in rows}
    bench.gates += [
        Gate("two_phase_vs_sdpa_64x8k", by["64x8k"]["speedup"], 4),
        Gate("two_phase_vs_sdpa_16x1k", by["16x1k"]["speedup"], 1),
    ]
    return rows


def _graphed(bench: GpuBench, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once as a CUDA graph (its replay) on CUDA; ``fn`` itself elsewhere."""
    if not bench.device.startswith("cuda"):
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _time_us(bench: GpuBench, fn: Callable[[], object], calls: int = 50) -> float:
    for _ in range(5):
        fn()
    bench.sync()
    began = time.perf_counter()
    for _ in range(calls):
        fn()
    bench.sync()
    return (time.perf_counter() - began) / calls * 1e6


def serving(bench: GpuBench) -> list[dict[str, Any]]:
    """32 requests sharing 4K tokens, 32 new tokens each: the scheduler against one at a time."""
    from pc_rag.bench.serve import serve_benchmark
    from pc_rag.engine import PromptCache
    from pc_rag.runtime.scheduler import Scheduler

    pc = PromptCache(bench.lm)
    concurrency, shared = max(2, 32 // bench.shape.scale), bench.tokens(4096)
    scheduler = Scheduler(bench.lm, max_batch=concurrency, shared_tokens=2 * shared, queue_limit=4 * concurrency)
    result = scheduler.run(lambda: serve_benchmark(pc, scheduler, shared_tokens=shared, new_tokens=32))
    row = {"concurrency": concurrency, "shared_tokens": shared, "tokens_per_s": round(result.tokens_per_s, 1),
           "single_tokens_per_s": round(result.single_tokens_per_s, 1), "speedup": round(result.speedup, 2),
           "identical_to_served_alone": result.identical,
           "identical_to_one_at_a_time": result.identical_to_unbatched}  # fmt: skip
    bench.on_progress(f"   {row}")
    bench.gates += [
        Gate("serving_tokens_per_s_32x4k", row["tokens_per_s"], 2000, unit="tok/s"),
        Gate("serving_speedup_32x4k", row["speedup"], 15),
    ]
    return [row]


FIDELITY_GATES = ["runner_relative_logit_error", "runner_decode_relative_logit_error", "runner_relative_kv_error",
                  "capture_changed_cached_values"]  # fmt: skip


def graph_fidelity(bench: GpuBench, steps: int = 4) -> list[dict[str, Any]]:
    """The runner (replayed graphs on CUDA, the static path on the CPU) against the model's own forward: the new
    tokens' logits, then ``steps`` decode steps' logits, then every slot's key and value (random weights give
    near-uniform attention, so a mask, RoPE or slot error barely moves the logits but shows in the KV); and the
    cached slots, bit for bit, across the captures the first forward triggers."""
    from pc_rag.kv import allocate

    model, device = bench.lm.model, bench.device
    runner = bench.runner()
    prompt = list(range(10, 10 + bench.tokens(1024)))
    ours, theirs = allocate(model, 4096), allocate(model, 4096)

    def plain(cache: Any, ids: list[int], at: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([at], device=device),
                     **with_cache(cache), use_cache=True).logits[0, -1]  # fmt: skip

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).abs().max() / b.float().abs().max())

    with torch.inference_mode():
        for buffer in (ours, theirs):
            model(input_ids=torch.tensor([prompt], device=device), **with_cache(buffer.cache(0)), use_cache=True)
        cached = (ours.keys[..., : len(prompt), :].clone(), ours.values[..., : len(prompt), :].clone())
        ids, at = [5, 6, 7, 8], [len(prompt) + i for i in range(4)]
        logits, cache = runner.forward(ours, len(prompt), ids, at)  # a new buffer: every bucket captured first
        changed = sum(int((now != then).sum()) for now, then in zip(  # captures since: the same tensors, no slot
            (ours.keys[..., : len(prompt), :], ours.values[..., : len(prompt), :]), cached, strict=True))  # fmt: skip
        reference = plain(theirs.cache(len(prompt)), ids, at)
        error, argmax_equal = relative(logits, reference), bool(logits.argmax() == reference.argmax())
        step_errors = []
        for position, token in enumerate(range(20, 20 + steps), start=at[-1] + 1):
            length = cache.get_seq_length()
            step = runner.decode(token, position, cache)
            step_errors.append(relative(step, plain(theirs.cache(length), [token], [position])))
        length = cache.get_seq_length()
        kv_error = max(relative(mine[..., :length, :], want[..., :length, :])
                       for mine, want in ((ours.keys, theirs.keys), (ours.values, theirs.values)))  # fmt: skip
    row = {"graphs": runner.graphs, "static": runner.static, "relative_error": error,
           "decode_relative_errors": step_errors, "relative_kv_error": kv_error, "cached_values_changed": changed,
           "argmax_equal": argmax_equal}  # fmt: skip
    tolerance = 5e-2 if bench.lm.dtype == torch.bfloat16 else 1e-4
    bench.gates += [
        Gate(FIDELITY_GATES[0], round(error, 5), tolerance, at_least=False, unit=""),
        Gate(FIDELITY_GATES[1], round(max(step_errors), 5), tolerance, at_least=False, unit=""),
        Gate(FIDELITY_GATES[2], round(kv_error, 5), tolerance, at_least=False, unit=""),
        Gate(FIDELITY_GATES[3], changed, 0, at_least=False, unit="values"),
    ]
    return [row]


SECTIONS: dict[str, tuple[Callable[[GpuBench], Any], list[str]]] = {
    "fidelity": (graph_fidelity, FIDELITY_GATES),
    "ttft": (ttft_prompt_cache, ["prompt_cache_speedup_2k", "prompt_cache_speedup_8k", "prompt_cache_speedup_32k",
                                 "prompt_cache_cached_ttft_2k_ms"]),
    "rag": (rag_modes, ["rag_prefix_speedup_1.3k", "rag_prefix_speedup_8k", "rag_default_speedup_1.3k",
                        "rag_default_speedup_8k"]),
    "decode": (decode_speed, ["decode_tokens_per_s_1k", "decode_tokens_per_s_8k", "full_prefill_decode_vs_cached"]),
    "attention": (attention_two_phase, ["two_phase_vs_sdpa_64x8k", "two_phase_vs_sdpa_16x1k"]),
    "serving": (serving, ["serving_tokens_per_s_32x4k", "serving_speedup_32x4k"]),
}  # fmt: skip
