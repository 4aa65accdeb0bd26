"""The harness of ``pc-rag bench gpu``: model shapes, gates, the bench state each section reads and writes,
and the random-weight model. This module knows nothing about the sections' workloads."""

from __future__ import annotations

import statistics
import subprocess
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pc_rag.errors import PCRagError


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
