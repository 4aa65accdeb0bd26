"""``pc-rag bench gpu``: every GPU acceptance gate in one process, on a random-weight model of a real shape.

No weights travel: the model is built from a config of a real model's shape (``SHAPES``) with random weights, in
bfloat16 on CUDA (float32 on the CPU), so timings are real and answers meaningless. Only a tokenizer directory is
needed (``--tokenizer``; default: the bundled SmolLM2's converted tokenizer). Each section is guarded: one that
fails records its error and its gates as unmet, and the rest still run. The JSON holds ``device``, ``torch``,
``commit``, ``shape`` and ``gates`` (``name``, ``value``, ``threshold``, ``met``), then each section's raw rows.

``--shape tiny`` runs the same code at small sizes (contexts divided by ``scale``) so that CI runs it on a CPU;
its gates are computed the same way and mean nothing there. This module knows nothing about HTTP or stores.
"""

from __future__ import annotations

import statistics
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pc_rag.errors import PCRagError
from pc_rag.runtime.model_call import with_cache


@dataclass(frozen=True)
class Shape:
    """A decoder's shape (Llama or Qwen2 architecture) and the factor its benchmark sizes are divided by."""

    arch: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    vocab: int = 0  # the real model's vocabulary (its lm_head and argmax cost); 0: the tokenizer's
    scale: int = 1  # contexts, batch sizes and private lengths are divided by this (tiny shapes on a CPU)


SHAPES = {
    "llama-3b": Shape("llama", 28, 3072, 8192, 24, 8, 128, 500000.0, vocab=128256),
    "llama-8b": Shape("llama", 32, 4096, 14336, 32, 8, 128, 500000.0, vocab=128256),
    "qwen-7b": Shape("qwen2", 28, 3584, 18944, 28, 4, 128, 1000000.0, vocab=152064),
    "tiny": Shape("llama", 2, 128, 256, 4, 2, 32, 10000.0, scale=8),
}


@dataclass
class Gate:
    """One acceptance line: ``value`` compared with ``threshold`` (``at_least``: value >= threshold)."""

    name: str
    value: float | None
    threshold: float
    at_least: bool = True
    unit: str = "x"

    @property
    def met(self) -> bool:
        if self.value is None:
            return False
        return self.value >= self.threshold if self.at_least else self.value <= self.threshold

    def as_json(self) -> dict[str, Any]:
        sign = ">=" if self.at_least else "<="
        return {"name": self.name, "value": self.value, "threshold": f"{sign} {self.threshold:g}", "unit": self.unit,
                "met": self.met}  # fmt: skip


@dataclass
class GpuBench:
    """The benchmark's state: the model, the device, the gates so far and each section's rows."""

    shape_name: str
    shape: Shape
    device: str
    tokenizer_dir: Path
    runs: int = 3
    gates: list[Gate] = field(default_factory=list)
    sections: dict[str, Any] = field(default_factory=dict)
    lm: Any = None
    on_progress: Callable[[str], None] = print
    static_calls: dict[str, int] = field(default_factory=dict)
    eager_fallbacks: dict[str, int] = field(default_factory=dict)
    interrupted: str | None = None  # the section a SIGINT (``timeout -s INT``) stopped
    running: str | None = None  # the section running now

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def tokens(self, n: int) -> int:
        """A context of ``n`` tokens at this shape's scale (at least 256: the passages and the question fit)."""
        return max(256, n // self.shape.scale)

    def median_ms(self, run: Callable[[], float]) -> float:
        """The median of ``runs`` timings after one warm-up; ``run`` returns its own milliseconds."""
        run()
        return statistics.median(run() for _ in range(self.runs))

    def section(self, name: str, body: Callable[[], Any], gates: list[str]) -> None:
        """Run ``body`` (it appends gates); on failure record the error and ``gates`` as unmet."""
        self.running, began = name, time.perf_counter()
        self.on_progress(f"== {name}")
        runner = self.runner()
        runner.take_calls()
        try:
            self.sections[name] = {"rows": body(), "seconds": round(time.perf_counter() - began, 1)}
        except KeyboardInterrupt:
            self.sections[name] = {"error": "interrupted (SIGINT)", "seconds": round(time.perf_counter() - began, 1)}
            raise
        except Exception as e:  # noqa: BLE001 - a failed section is a result of the benchmark, and the rest still run
            self.sections[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            self.gates.extend(Gate(g, None, 0) for g in gates if g not in {x.name for x in self.gates})
            self.on_progress(f"   {name} failed: {type(e).__name__}: {e}")
        finally:
            from pc_rag.runtime.model_runner import CALL_KINDS

            calls = runner.take_calls()
            self.static_calls[name], self.eager_fallbacks[name] = calls["static"], calls["fallback"]
            self.sections[name]["runner_calls"] = {kind: calls[kind] for kind in CALL_KINDS}
        self.running = None  # not reached when interrupted: the run's end reads which section was

    def runner(self) -> Any:
        """The model's runner: on the CPU in its bookkeeping mode, so every call CUDA would replay as a graph runs
        the static-shape path (eagerly) and is counted."""
        from pc_rag.runtime.model_runner import ModelRunner

        runner = ModelRunner.of(self.lm.model)
        if not runner.static and not self.device.startswith("cuda"):
            runner.enable_static()
        return runner

    def result(self, total_s: float) -> dict[str, Any]:
        device = torch.cuda.get_device_name() if self.device.startswith("cuda") else _cpu_name()
        return {
            "device": device, "torch": torch.__version__, "commit": _commit(), "shape": self.shape_name,
            "shape_config": self.shape.__dict__, "dtype": self.lm.compute_dtype if self.lm else None,
            "gates": [g.as_json() for g in self.gates], "static_calls": self.static_calls,
            "eager_fallbacks": self.eager_fallbacks, "interrupted": self.interrupted, "sections": self.sections,
            "total_s": round(total_s, 1),
        }  # fmt: skip


def build_model(shape: Shape, device: str, tokenizer_dir: Path) -> Any:
    """A random-weight model of ``shape`` on ``device`` (bf16 on CUDA, float32 elsewhere) with the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    from pc_rag.attention import ATTENTION
    from pc_rag.model import LoadedModel
    from pc_rag.rope import rope_spec_for
    from pc_rag.weights import compute_dtype

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        msg = f"no tokenizer in {tokenizer_dir}: give --tokenizer DIR (a directory with tokenizer.json)"
        raise PCRagError(msg) from e
    config_class = Qwen2Config if shape.arch == "qwen2" else LlamaConfig
    config = config_class(
        vocab_size=max(len(tokenizer), shape.vocab), hidden_size=shape.hidden, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim, max_position_embeddings=65536, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta},
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    dtype = "bfloat16" if device.startswith("cuda") else "float32"
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype), attn_implementation=ATTENTION)
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, rope=rope_spec_for(model), name=f"random-{shape.arch}",
                       compute=compute_dtype(dtype))  # fmt: skip


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


TIMED = ("ttft", "rag", "decode", "serving")
"""The sections whose cached requests and decode steps are timed: each must take the static-shape path."""
STATIC_GATE = "timed_eager_fallbacks"


def run_gpu_bench(
    shape: str,
    device: str,
    tokenizer_dir: Path,
    *,
    only: list[str] | None = None,
    runs: int = 3,
    on_progress: Callable[[str], None] = print,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run the chosen sections (default: all) and return the JSON-ready result.

    ``on_result`` receives the result so far before the model is built and after every section (partial results
    are results). A SIGINT (``KeyboardInterrupt``, as ``timeout -s INT`` sends) ends the run: the result says which
    section it stopped (``interrupted``) and holds every section before it."""
    if shape not in SHAPES:
        msg = f"unknown shape {shape!r}: choose one of {', '.join(SHAPES)}"
        raise PCRagError(msg)
    unknown = sorted(set(only or ()) - set(SECTIONS))
    if unknown:
        msg = f"unknown section(s) {', '.join(unknown)}: choose from {', '.join(SECTIONS)}"
        raise PCRagError(msg)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PCRagError("--device cuda, but torch sees no CUDA device (a CPU build of torch, or no GPU)")
    began = time.perf_counter()
    bench = GpuBench(shape, SHAPES[shape], device, tokenizer_dir, runs=runs, on_progress=on_progress)
    report = on_result or (lambda _: None)
    try:
        bench.interrupted = "build"  # until the model is built
        report(bench.result(time.perf_counter() - began))
        bench.lm = build_model(bench.shape, device, tokenizer_dir)
        bench.interrupted = None
        for name, (body, gates) in SECTIONS.items():
            if only is None or name in only:
                bench.section(name, lambda body=body: body(bench), gates)
                _static_gate(bench)
                report(bench.result(time.perf_counter() - began))
    except KeyboardInterrupt:
        bench.interrupted = bench.interrupted or bench.running or "between sections"
        if bench.running is not None:
            bench.sections.setdefault(bench.running, {"error": "interrupted (SIGINT)"})
        on_progress(f"   interrupted in {bench.interrupted}: the result holds every section before it")
        known = {g.name for g in bench.gates}
        bench.gates += [Gate(g, None, 0) for name, (_, gates) in SECTIONS.items() if only is None or name in only
                        for g in gates if g not in known]  # fmt: skip
    result = bench.result(time.perf_counter() - began)
    report(result)
    return result


def _static_gate(bench: GpuBench) -> None:
    """Every timed cached request and decode step took the static-shape path (a graph replay on CUDA): the
    eager fallbacks of the timed sections that ran, at most 0 (unmet, with no value, if one failed)."""
    timed = [name for name in TIMED if name in bench.sections]
    if not timed:
        return
    failed = any("error" in bench.sections[name] for name in timed)
    value = None if failed else sum(bench.eager_fallbacks[name] for name in timed)
    bench.gates = [g for g in bench.gates if g.name != STATIC_GATE]
    bench.gates.append(Gate(STATIC_GATE, value, 0, at_least=False, unit="calls"))


def format_gates(result: dict[str, Any]) -> str:
    """The gates as a markdown table, with the device and shape."""
    lines = [f"{result['shape']} on {result['device']} (torch {result['torch']}, commit {result['commit']})", "",
             "| gate | value | threshold | met |", "|---|---|---|---|"]  # fmt: skip
    for gate in result["gates"]:
        value = "not run" if gate["value"] is None else f"{gate['value']:g} {gate['unit']}".strip()
        lines.append(
            f"| {gate['name']} | {value} | {gate['threshold']} {gate['unit']} | {'yes' if gate['met'] else 'no'} |"
        )
    return "\n".join(lines)


def default_tokenizer_dir() -> Path:
    """The bundled SmolLM2's converted directory (it holds tokenizer.json), once a command converted it here."""
    from pc_rag.model import cache_dir

    found = sorted((cache_dir() / "models").glob("SmolLM2-135M-Instruct*/tokenizer.json"))
    if not found:
        msg = (
            "no converted SmolLM2 tokenizer here: run any pc-rag command once on the bundled model, or give --tokenizer"
        )
        raise PCRagError(msg)
    return found[0].parent


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).parent)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} ({torch.backends.cpu.get_cpu_capability()})"
    except OSError:
        pass
    return f"CPU ({torch.backends.cpu.get_cpu_capability()})"
