"""The GPU acceptance run cannot lose its results: cut by a SIGINT (as ``timeout -s INT`` sends), ``pc-rag bench
gpu`` writes the sections it finished and which one it stopped; the script cut by its own limit leaves JSON."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pc_rag.bench.gpu import SECTIONS

TOKENIZER = Path(__file__).parent / "data" / "tiny-tokenizer"
ROOT = Path(__file__).parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    ("only", "cut"),
    [("fidelity,ttft", "ttft"), ("fidelity,serving", "serving")],  # serving: a driver thread is left waiting
)
def test_sigint_in_a_section_keeps_those_before_and_exits_130(tmp_path: Path, only: str, cut: str) -> None:
    out = tmp_path / "gpu_tiny.json"
    argv = [sys.executable, "-m", "pc_rag.cli", "--device", "cpu", "bench", "gpu", "--shape", "tiny", "--tokenizer",
            str(TOKENIZER), "--only", only, "--runs", "100000", "--json", str(out)]  # fmt: skip
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, cwd=ROOT,
        preexec_fn=ignore_sigint,  # as a shell starts a background job: the bench must still honour SIGINT
    )  # fmt: skip
    assert process.stdout is not None
    for line in process.stdout:  # ttft never ends at 100,000 runs: the SIGINT must end it
        if line.startswith(f"== {cut}"):
            process.send_signal(signal.SIGINT)
            break
    rest = process.communicate(timeout=60)[0]  # within timeout's grace (-k 15 in the script) on a loaded CI core
    assert process.returncode == 130, rest
    result = json.loads(out.read_text())
    assert result["interrupted"] == cut
    assert "rows" in result["sections"]["fidelity"] and "interrupted" in result["sections"][cut]["error"]
    gates = {g["name"]: g for g in result["gates"]}
    assert gates["runner_relative_logit_error"]["met"]
    cut_gate = SECTIONS[cut][1][0]
    assert gates[cut_gate]["value"] is None and not gates[cut_gate]["met"]
    # the new tokens and four decode steps, all on the static path
    assert result["static_calls"]["fidelity"] == 5 and result["eager_fallbacks"]["fidelity"] == 0


def test_the_script_cut_by_its_limit_leaves_partial_json(tmp_path: Path) -> None:
    env = {**ENV, "OUT": str(tmp_path), "SHAPES": "tiny:10", "DEVICE": "cpu", "TOKENIZER": str(TOKENIZER),
           "RUNS": "100000"}  # fmt: skip
    done = subprocess.run(["bash", "examples/gpu/acceptance.sh"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert "== tiny: exit" in done.stdout, done.stdout + done.stderr
    result = json.loads((tmp_path / "gpu_tiny.json").read_text())
    assert result["shape"] == "tiny" and result["interrupted"]  # cut somewhere: startup, build or a section
    assert (tmp_path / "gpu_tiny.log").is_file()
