"""The ``pc-rag`` command asks PyTorch for transparent huge pages before torch's first allocation
(``pc_rag.huge_pages``); a process that does not, or that set the variable itself, keeps 4 KB pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pc_rag.huge_pages import VARIABLE, kernel_mode

# A 64 MB tensor allocated after `prelude`: its variable's value, and the KB of its mapping on huge pages
PROBE = """
{prelude}
import os, torch
t = torch.ones(16 * 2**20)
address, huge = t.data_ptr(), None
with open("/proc/self/smaps") as f:
    for line in f:
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= address < high
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1])
print(os.environ.get("{variable}"), huge)
"""


def _probe(prelude: str, **env: str) -> tuple[str, int]:
    environ = {k: v for k, v in os.environ.items() if k != VARIABLE} | env
    code = PROBE.format(prelude=prelude, variable=VARIABLE)
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)
    value, huge = out.stdout.split()
    return value, int(huge)


def test_the_cli_package_sets_the_variable_unless_it_is_set() -> None:
    assert _probe("import pc_rag.cli")[0] == "1"
    assert _probe("import pc_rag.cli", **{VARIABLE: "0"})[0] == "0"
    assert _probe("import pc_rag")[0] == "None", "the library alone leaves the allocator alone"


@pytest.mark.skipif(kernel_mode() != "madvise", reason="huge pages only on request: the kernel's THP mode is madvise")
def test_a_large_tensor_lands_on_huge_pages_after_the_cli_is_imported_and_not_before() -> None:
    assert _probe("import pc_rag.cli")[1] > 0
    assert _probe("import pc_rag")[1] == 0


def test_the_kernel_mode_is_read_or_none() -> None:
    assert kernel_mode() in (None, "always", "madvise", "never")
