"""Transparent huge pages for PyTorch's large CPU tensors, asked for before torch allocates anything.

PyTorch backs a CPU allocation of 2 MB or more with 2 MB pages (``madvise(MADV_HUGEPAGE)``) when
``THP_MEM_ALLOC_ENABLE=1`` is set; it reads the variable once, at its first allocation. The KV a server holds (the
private arena, the shared pool, the spliced buffers) is hundreds of MB written once and read every decode step: on
4 KB pages, a request that first writes a fresh 47 MB arena row pays about 12,000 page faults (measured: 88 ms of a
conversation turn's 700 ms), and every step walks the page tables of the whole pool. The ``pc-rag`` command turns it
on (unless the variable is already set); a library leaves a process's allocator alone, so a program importing
``pc_rag`` sets the variable itself. Where the kernel's THP mode is ``never``, the request is a no-op.
"""

from __future__ import annotations

import os

VARIABLE = "THP_MEM_ALLOC_ENABLE"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def ask_for_huge_pages() -> None:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` for this process unless it is set; effective only before torch's first
    allocation."""
    os.environ.setdefault(VARIABLE, "1")


def kernel_mode() -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``), or None where it does not say."""
    try:
        with open(THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None
