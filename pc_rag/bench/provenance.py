"""Where a benchmark's figures came from: the commit of the pc_rag checkout that ran it, and the machine."""

from __future__ import annotations

import subprocess
from pathlib import Path

import torch


def commit() -> str:
    """The checkout's commit that this pc_rag runs from (empty when it is not in one), wherever the command runs."""
    here = Path(__file__).resolve().parent
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False, cwd=here)
    return git.stdout.strip()


def machine() -> dict[str, str]:
    """The CPU's model name and the vector extensions that decide which kernels run."""
    info = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return {
        "model": fields.get("Model name", "").strip(),
        "flags": " ".join(f for f in wanted if f in flags),
        "cores": str(torch.get_num_threads()),
    }
