"""Crash-safe file replacement: write a temp file beside the target, fsync it, ``os.replace`` it in.

A reader sees either the old file or the new one, never a torn write. This
module knows nothing about what the files contain.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

_BLOCK = 1 << 20


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call ``write`` on a temp file in ``path``'s directory, then atomically move it to ``path``."""
    with staged(path) as tmp:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    fsync_dir(path.parent)


@contextlib.contextmanager
def staged(path: Path) -> Iterator[Path]:
    """A fresh temp path beside ``path``; removed on exit unless it was moved into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to disk (for files written by a library that does not fsync)."""
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(directory: Path) -> None:
    """Persist a rename in ``directory`` (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself is still atomic
    finally:
        os.close(fd)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()
