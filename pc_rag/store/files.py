"""What a store directory holds, by name: the manifest, versioned index files, KV shards, codec tables, the
writer's lock.

``manifest.json`` is the commit point: it names the one index file and the
shards that make up the store. Anything else in the directory that looks like
ours (an index file or shard it does not name, a temp file) is left over from
an interrupted or superseded write. Readers ignore such files; only the writer,
holding the lock, removes them. Names read from a manifest are validated here,
so a damaged or hostile manifest cannot point outside the store.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from pc_rag.errors import StoreCorruptedError, StoreError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
LOCK_NAME = ".writer.lock"
SHARD_DIR = "kv"
LEGACY_INDEX_NAME = "index.faiss"  # format 1: one index file, rewritten in place, no checksum

_SHARD = re.compile(rf"{SHARD_DIR}/\d{{8}}-[0-9a-f]{{8}}\.safetensors")
_INDEX = re.compile(r"index-\d{8}\.faiss")
_TABLES = re.compile(r"codec-[0-9a-f]{16}\.safetensors")


def index_name(generation: int) -> str:
    """The index file committed with manifest ``generation``."""
    return f"index-{generation:08d}.faiss"


def check_shard_name(name: str) -> str:
    """``name`` if it is a shard name this store could have written; ``StoreCorruptedError`` otherwise."""
    if not _SHARD.fullmatch(name):
        msg = f"the store manifest lists a KV shard named {name!r}, which is not a shard name (kv/NNNNNNNN-xxxxxxxx)"
        raise StoreCorruptedError(msg)
    return name


def check_index_name(name: str) -> str:
    """``name`` if it is an index file name this store could have written; ``StoreCorruptedError`` otherwise."""
    if not (_INDEX.fullmatch(name) or name == LEGACY_INDEX_NAME):
        msg = f"the store manifest names the index file {name!r}, which is not an index name (index-NNNNNNNN.faiss)"
        raise StoreCorruptedError(msg)
    return name


def tables_name(digest: str) -> str:
    """The file of the CacheGen tables with content digest ``digest``."""
    return f"codec-{digest}.safetensors"


def check_tables_name(name: str) -> str:
    """``name`` if it is a codec table file name this store could have written; ``StoreCorruptedError`` otherwise."""
    if not _TABLES.fullmatch(name):
        msg = f"the store manifest names the codec tables {name!r}, which is not a table name (codec-<16 hex>)"
        raise StoreCorruptedError(msg)
    return name


def check_store_directory(directory: Path, *, for_new_store: bool = True) -> bool:
    """Whether ``directory`` holds a store; ``StoreError`` if it is a file, or (``for_new_store``) a directory
    with files but no store: a new store must not be built among someone's files."""
    if directory.exists() and not directory.is_dir():
        msg = f"{directory} is a file; a store is a directory"
        raise StoreError(msg)
    if (directory / MANIFEST_NAME).is_file():
        return True
    foreign = (
        [p for p in directory.iterdir() if p.name != LOCK_NAME and not _TABLES.fullmatch(p.name)]
        if (for_new_store and directory.is_dir())
        else []
    )  # the lock, and codec tables a creation installs before its first commit, may precede a store
    if foreign:
        msg = f"{directory} is not empty: a non-empty directory that holds no store cannot take one; give an empty one"
        raise StoreError(msg)
    return False


def refuse_existing(directory: Path) -> None:
    """``StoreError`` unless ``directory`` can take a new store (new, or empty)."""
    if check_store_directory(directory):
        msg = f"{directory} already holds a store; use DocumentStore.load"
        raise StoreError(msg)


def remove_unlisted(directory: Path, listed: set[str]) -> int:
    """Delete the files ``unlisted`` names (only a writer holding the lock may); return how many."""
    stray = unlisted(directory, listed)
    for path in stray:
        logger.info("removing %s: not listed in the manifest", path)
        path.unlink(missing_ok=True)
    return len(stray)


def unlisted(directory: Path, listed: set[str]) -> list[Path]:
    """Files of ours in ``directory`` that ``listed`` (names relative to it) does not contain.

    Shards, index files and temp files of interrupted writes; never the manifest, the lock or a user's file.
    """
    candidates = [
        *directory.glob(f"{SHARD_DIR}/*"), *directory.glob("index*.faiss"), *directory.glob("codec-*.safetensors"),
        *directory.glob(".*.tmp"),
    ]  # fmt: skip
    ours = [p for p in candidates if p.is_file() and _is_ours(p.relative_to(directory).as_posix())]
    return sorted(p for p in ours if p.relative_to(directory).as_posix() not in listed)


def _is_ours(name: str) -> bool:
    return bool(
        _SHARD.fullmatch(name)
        or _INDEX.fullmatch(name)
        or _TABLES.fullmatch(name)
        or name == LEGACY_INDEX_NAME
        or (name.rsplit("/", 1)[-1].startswith(".") and name.endswith(".tmp"))
    )


def bytes_on_disk(directory: Path) -> int:
    """Bytes of every file under ``directory``."""
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
