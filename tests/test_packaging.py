"""The wheel holds every package: it is built from a copy of the sources, installed into a fresh venv (no
network: ``--no-deps``; dependencies from the running environment's site-packages, named in a ``.pth`` file), and
every subpackage is imported from the installed copy, not from the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="venv layout (bin/python)")

ROOT = Path(__file__).parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "pc_rag", "integrations", "retrievers")

IMPORT_ALL = """
import importlib, json, pkgutil, sys
import pc_rag
names = ["pc_rag"] + [m.name for m in pkgutil.walk_packages(pc_rag.__path__, "pc_rag.") if m.ispkg]
files = {name: importlib.import_module(name).__file__ for name in names}
print(json.dumps({"prefix": sys.prefix, "files": files}))
"""


def _packages_in_checkout() -> set[str]:
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pc_rag").rglob("__init__.py")}
    for adapters in ("integrations", "retrievers"):
        found |= {
            "pc_rag." + ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / adapters).rglob("__init__.py")
        }
    return found


def _see_running_environment(python: Path) -> None:
    """Let the venv of ``python`` import the running environment's dependencies: a ``.pth`` file names the
    site-packages this interpreter imports from (a venv's, a conda env's or a system install's, and the user's).

    ``venv --system-site-packages`` would not do: it exposes the *base* interpreter's site-packages, so under an
    outer venv torch and the rest would be missing. Plain path lines add the directories after the venv's own
    site-packages without running their ``.pth`` files, so the outer editable pc-rag is not installed there."""
    site_dirs = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib).mkdir(parents=True, exist_ok=True)
    (Path(purelib) / "running_environment.pth").write_text("".join(f"{d}\n" for d in site_dirs))


def test_the_wheel_installs_and_imports_every_subpackage(tmp_path: Path) -> None:
    import json

    src = tmp_path / "src"
    for name in SOURCES:  # a copy: building writes build/ and egg-info next to the sources
        path = ROOT / name
        if not path.exists():
            continue
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), "."],
                   cwd=src, check=True, capture_output=True)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("pc_rag-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    _see_running_environment(python)
    # --ignore-installed: without it pip uninstalls the pc-rag of the running environment (the editable install the
    # rest of the suite imports) before installing into the prefix
    install = [*pip, "install", "--no-deps", "--ignore-installed", "--prefix", str(venv), str(wheel)]
    subprocess.run(install, check=True, capture_output=True)
    run = subprocess.run([str(python), "-c", IMPORT_ALL], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert Path(report["prefix"]) == venv
    assert set(report["files"]) == _packages_in_checkout()
    outside = {name: f for name, f in report["files"].items() if not Path(f).is_relative_to(venv)}
    assert not outside, f"imported from outside the installed wheel: {outside}"
    assert (Path(report["files"]["pc_rag"]).parent / "data" / "hotpotqa_sample.jsonl").is_file()
    csrc = Path(report["files"]["pc_rag"]).parent / "runtime" / "csrc"
    shipped = {path.name for path in csrc.iterdir()}
    sources = Path(__file__).parents[1] / "pc_rag" / "runtime" / "csrc"
    assert {path.name for path in sources.iterdir() if path.suffix in {".cpp", ".h"}} <= shipped  # the kernels' sources
    still = subprocess.run([*pip, "show", "pc-rag"], capture_output=True, text=True)
    assert still.returncode == 0, "the test uninstalled the environment's own pc-rag"
