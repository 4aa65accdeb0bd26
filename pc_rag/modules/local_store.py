"""Module KV in a local (or shared-filesystem) directory: one framed file per key, written atomically.

A key ``pc-rag/v1/<model>/<encoding>/<content>`` is the file ``<root>/<model>/<encoding>/<content>.pcrm``;
a write is a temp file, fsync and rename, so a reader sees a whole module or none, and concurrent writers of
one key (who write the same bytes: keys name content) cannot tear it. Every value is framed with a checksum.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from pc_rag.errors import ModuleStoreError, ModuleStoreFullError
from pc_rag.modules.framing import frame, unframe

_KEY = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")
SUFFIX = ".pcrm"


class LocalModuleStore:
    """``ModuleStore`` on the directory ``root`` (created if missing)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ModuleStoreError(f"cannot use {self.root} as a module store: {e}") from e
        self.url = self.root.resolve().as_uri()

    def put(self, key: str, value: bytes) -> None:
        path = self._path(key)
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(frame(value))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            error = ModuleStoreFullError if e.errno == 28 else ModuleStoreError  # ENOSPC
            raise error(f"the module store at {self.root} cannot write {key}: {e}") from e
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)

    def get(self, key: str) -> bytes | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise ModuleStoreError(f"the module store at {self.root} cannot read {key}: {e}") from e
        return unframe(data, key)

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> bool:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def put_many(self, items: Mapping[str, bytes]) -> None:
        for key, value in items.items():
            self.put(key, value)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(key) for key in keys]

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.contains(key) for key in keys]

    def delete_many(self, keys: Iterable[str]) -> int:
        return sum(self.delete(key) for key in keys)

    def close(self) -> None:
        """Nothing to release: every call opens and closes its file."""

    def __enter__(self) -> LocalModuleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _path(self, key: str) -> Path:
        """The file of ``key``; ``ModuleStoreError`` for keys that could leave the root (``..``, absolute)."""
        if not _KEY.fullmatch(key) or any(part in (".", "..") for part in key.split("/")):
            raise ModuleStoreError(f"{key!r} is not a module key (letters, digits, '.', '_', '-' and '/')")
        return self.root.joinpath(*key.split("/")).with_name(key.rsplit("/", 1)[-1] + SUFFIX)
