"""The last commit of a store directory, read consistently while a writer may be replacing it.

A commit is a manifest naming one checksummed index file (format 1: ``index.faiss``, no checksum).
A reader that finds the named index gone or changed retries when the manifest moved on meanwhile.
This module knows nothing about models or serving.
"""

from __future__ import annotations

from pathlib import Path

from pc_rag.errors import StoreCorruptedError
from pc_rag.store._atomic import sha256_file
from pc_rag.store.files import LEGACY_INDEX_NAME
from pc_rag.store.index import VectorIndex
from pc_rag.store.manifest import MANIFEST_NAME, Manifest


def read_commit(directory: Path, attempts: int = 5) -> tuple[Manifest, VectorIndex]:
    """The committed manifest and the index it names, read consistently while a writer may be committing."""
    for attempt in range(attempts):
        manifest = Manifest.load(directory / MANIFEST_NAME)
        try:
            return manifest, _load_index(directory, manifest)
        except StoreCorruptedError:
            moved = Manifest.load(directory / MANIFEST_NAME).generation != manifest.generation
            if not moved or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _load_index(directory: Path, manifest: Manifest) -> VectorIndex:
    if manifest.index is None:  # format 1
        return VectorIndex.load(directory / LEGACY_INDEX_NAME)
    path = directory / manifest.index.name
    try:
        actual = sha256_file(path)
    except FileNotFoundError as e:
        msg = f"vector index file is missing: {path}"
        raise StoreCorruptedError(msg) from e
    if actual != manifest.index.sha256:
        msg = f"vector index file {path} does not match its checksum (sha256 {actual[:12]}…); run `pc-rag store repair`"
        raise StoreCorruptedError(msg)
    return VectorIndex.load(path)


def manifest_stamp(directory: Path) -> tuple[int, int, int] | None:
    """What changes when the manifest is replaced: inode, size, modification time."""
    try:
        st = (directory / MANIFEST_NAME).stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns
