"""Where a benchmark's figures came from: the commit of the pc_rag checkout that ran it."""

from __future__ import annotations

import subprocess
from pathlib import Path


def commit() -> str:
    """The checkout's commit that this pc_rag runs from (empty when it is not in one), wherever the command runs."""
    here = Path(__file__).resolve().parent
    git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False, cwd=here)
    return git.stdout.strip()
