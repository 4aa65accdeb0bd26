"""An error raised in a Ray actor keeps the note that says so on Python 3.10, which has no ``add_note``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pc_rag.errors import StoreError
from pc_rag.scaleout import ray_workers


@pytest.mark.parametrize("version", [(3, 10, 13), (3, 11, 0)])
def test_the_note_is_kept_on_every_python(monkeypatch: pytest.MonkeyPatch, version: tuple[int, ...]) -> None:
    monkeypatch.setattr(ray_workers, "sys", SimpleNamespace(version_info=version))
    error = ray_workers.with_note(StoreError("chunk 3 failed"), "(raised in an actor)")
    shown = "\n".join([str(error), *getattr(error, "__notes__", [])])
    assert type(error) is StoreError and shown == "chunk 3 failed" + (" " if version < (3, 11) else "\n") + (
        "(raised in an actor)"
    )
