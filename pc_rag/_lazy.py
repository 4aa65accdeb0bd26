"""Lazy package exports: a name loads its module (and that module's optional framework) on first use."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package`` whose ``exports`` map names to the modules defining them."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            msg = f"module {package!r} has no attribute {name!r}"
            raise AttributeError(msg)
        return getattr(import_module(exports[name]), name)

    def __dir__() -> list[str]:
        return sorted({*vars(import_module(package)), *exports})

    return __getattr__, __dir__
