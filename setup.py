"""Package discovery that pyproject.toml's tables cannot express: ``pc_rag`` and every package below it, plus
the adapters kept at the top of the repository (``integrations/``, ``retrievers/``), installed under ``pc_rag``
(``[tool.setuptools.package-dir]`` maps the directories). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

ADAPTERS = ("integrations", "retrievers")

setup(
    packages=[
        *find_packages(include=["pc_rag", "pc_rag.*"]),
        *(f"pc_rag.{name}" for name in find_packages(include=[p for a in ADAPTERS for p in (a, f"{a}.*")])),
    ]
)
