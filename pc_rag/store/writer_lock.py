"""One writer per store, across processes: an advisory lock file (``filelock``) taken before the first write.

Readers never take it and never wait for it: they read the last committed
manifest. A second writer fails at once with ``StoreLockedError`` rather than
queueing behind a long indexing job. The operating system releases the lock
when its holder dies, so a killed writer never leaves a store locked.
"""

from __future__ import annotations

from pathlib import Path

from filelock import FileLock, Timeout

from pc_rag.errors import StoreLockedError
from pc_rag.store.files import LOCK_NAME


class WriterLock:
    """The writer lock of the store in ``directory``; ``acquire`` is idempotent, ``release`` undoes it."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        self._lock = FileLock(self.path, timeout=0, is_singleton=False, thread_local=False)

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def acquire(self) -> None:
        """Take the lock, or raise ``StoreLockedError`` if another writer holds it."""
        if self.held:
            return
        try:
            self._lock.acquire()
        except Timeout as e:
            msg = (
                f"the store at {self.path.parent} is being written by another process or store object (lock file "
                f"{self.path}); wait for it to finish, or close it. Reading the store needs no lock"
            )
            raise StoreLockedError(msg) from e

    def release(self) -> None:
        if self.held:
            self._lock.release(force=True)
