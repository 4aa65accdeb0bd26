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

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pc_rag.bench.gpu_harness import SHAPES, Gate, GpuBench, Shape, build_model
from pc_rag.bench.gpu_sections import FIDELITY_GATES, SECTIONS
from pc_rag.errors import PCRagError

__all__ = [
    "FIDELITY_GATES",
    "SECTIONS",
    "SHAPES",
    "STATIC_GATE",
    "TIMED",
    "Gate",
    "GpuBench",
    "Shape",
    "build_model",
    "default_tokenizer_dir",
    "format_gates",
    "run_gpu_bench",
]


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
