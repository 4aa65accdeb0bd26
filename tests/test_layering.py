"""The layers import downward only: storage knows nothing of serving, the engines nothing of tools."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded_after(imports: list[str]) -> set[str]:
    """pc_rag modules loaded by a fresh interpreter that imports ``imports`` (every submodule of a package)."""
    code = f"""
import importlib, pkgutil, sys
for name in {imports!r}:
    module = importlib.import_module(name)
    for info in pkgutil.iter_modules(getattr(module, "__path__", []), name + "."):
        importlib.import_module(info.name)
print("\\n".join(m for m in sys.modules if m.startswith("pc_rag")))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize(
    ("layer", "forbidden"),
    [
        ("pc_rag.store", ("pc_rag.runtime", "pc_rag.server", "pc_rag.engine", "pc_rag.rag.engine")),
        # the runtime sits below the engines: no package cycle engine-runtime, baseline-runtime or rag-runtime
        (
            "pc_rag.runtime",
            (
                "pc_rag.engine",
                "pc_rag.baseline",
                "pc_rag.rag",
                "pc_rag.store",
                "pc_rag.server",
                "pc_rag.bench",
                "pc_rag.cli",
                "pc_rag.eval",
                "pc_rag.integrations",
            ),
        ),
        ("pc_rag.server", ("pc_rag.bench", "pc_rag.cli", "pc_rag.eval", "pc_rag.integrations")),
        ("pc_rag.engine", ("pc_rag.bench", "pc_rag.cli", "pc_rag.store", "pc_rag.server")),
        ("pc_rag.rag.engine", ("pc_rag.bench", "pc_rag.cli", "pc_rag.store", "pc_rag.server")),
    ],
)
def test_a_layer_does_not_load_the_layers_above_it(layer: str, forbidden: tuple[str, ...]) -> None:
    loaded = _loaded_after([layer])
    assert layer in loaded  # the probe did import it
    assert sorted(m for m in loaded if m.startswith(forbidden)) == []
