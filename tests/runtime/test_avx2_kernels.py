"""The batch-invariance tests again on PyTorch's and MKL's AVX2 kernels, so CI on an AVX-512 machine also covers
the machines that have AVX2 only (Zen 2): there the vector loops are 8 floats wide, not 16, and their tails fall
on other elements, so code that is batch-invariant on one instruction set need not be on the other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SAME_BITS = ["tests/runtime/test_batch_step.py", "tests/runtime/test_partition_attention.py",
             "tests/runtime/test_batch_prefill.py"]  # fmt: skip
# PyTorch picks its kernels by ATEN_CPU_CAPABILITY, MKL (torch's float32 GEMM here) by MKL_ENABLE_INSTRUCTIONS;
# no pytest plugins (the same_bits tests need none): half of the few seconds this takes would go to loading them
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
RUN = """import sys, pytest, torch
assert torch.backends.cpu.get_cpu_capability() == "AVX2", torch.backends.cpu.get_cpu_capability()
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-k", "same_bits", *sys.argv[1:]]))"""


@pytest.mark.skipif(
    not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
    reason="the suite already runs on this machine's kernels (AVX2 or another instruction set)",
)
def test_rows_get_the_same_bits_in_any_batch_on_the_avx2_kernels() -> None:
    """Every ``same_bits`` test of the batched steps and partition attention, in a subprocess on the AVX2 kernels
    (about 6 seconds, most of them imports)."""
    run = subprocess.run(
        [sys.executable, "-c", RUN, *SAME_BITS], env={**os.environ, **AVX2}, cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-500:]
