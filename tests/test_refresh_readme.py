"""The documents' result tables are rendered from committed JSON: examples/refresh_readme.py finds every marker in
README.md and docs/*.md, and examples/results_table.py renders what it names."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


refresh_readme = _load("refresh_readme")
results_table = _load("results_table")

TTFT = [
    {"context_tokens": 1018, "full_ttft_ms": 1632.99, "cached_ttft_ms": 155.21, "floor_ms": 159.22, "speedup": 10.52}
]
MARKER = "<!-- python examples/results_table.py examples/results/ttft.json -->"
TABLE = [
    "| context tokens | full prefill | cached | floor | speedup | cached / floor |",
    "|---|---|---|---|---|---|",
    "| 1,018 | 1,633 ms | 155.2 ms | 159.2 ms | 10.5x | 0.97x |",
]


def _tree(tmp_path: Path, readme_table: list[str], doc_table: list[str]) -> Path:
    (tmp_path / "examples" / "results").mkdir(parents=True)
    shutil.copy(EXAMPLES / "results_table.py", tmp_path / "examples" / "results_table.py")
    (tmp_path / "examples" / "results" / "ttft.json").write_text(json.dumps(TTFT), encoding="utf-8")
    (tmp_path / "README.md").write_text("\n".join(["# x", MARKER, *readme_table, "", "prose"]), encoding="utf-8")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "results.md").write_text("\n".join([MARKER, *doc_table, "", "more"]), encoding="utf-8")
    return tmp_path


def test_ttft_table_renders_every_figure_of_bench_ttft() -> None:
    assert results_table.ttft_table(TTFT).split("\n") == TABLE


def test_kernel_rows_render_with_the_time_a_step_spends_in_them() -> None:
    kernels = {"machine": {}, "layers": 30, "rows": [
        {"part": "attention", "kernel": "flash", "shape": "1024 slots", "us": 147.2, "bytes": 786432, "gb_s": 5.34,
         "floor_us": 20.1, "gap": 7.32},
        {"part": "int8 matmul, 1 row", "kernel": "lm_head", "shape": "bf16", "us": 2498.0, "bytes": 28409856,
         "gb_s": 11.37, "floor_us": 726.6, "gap": 3.44},
    ]}  # fmt: skip
    lines = results_table.render([kernels], None).split("\n")
    assert lines[2] == "| attention | flash | 1024 slots | 147 | 0.79 | 5.3 | 7.3x | 4.4 |"  # 30 layers a step
    assert lines[3] == "| int8 matmul, 1 row | lm_head | bf16 | 2,498 | 28.41 | 11.4 | 3.4x | 2.5 |"  # once a step


def test_sizes_go_to_the_rows_of_their_codec_level_only() -> None:
    rows = [{"mode": "default"}, {"mode": "default@cachegen:5"}]
    sized = results_table.with_sizes(rows, [{"codec": "cachegen:5", "bytes_per_token": 4757.0}])
    assert [r["bytes_per_token"] for r in sized] == [None, 4757.0]


def test_refresh_keeps_the_prose_around_a_table_and_reports_only_stale_blocks() -> None:
    text = "\n".join([MARKER, "| old |", "|---|", "", "prose", MARKER, *TABLE])
    new, stale = refresh_readme.refresh(text, lambda command: TABLE)
    assert new == "\n".join([MARKER, *TABLE, "", "prose", MARKER, *TABLE])
    assert stale == ["python examples/results_table.py examples/results/ttft.json"]


def test_check_covers_docs_and_a_refresh_fixes_them(tmp_path: Path) -> None:
    root = _tree(tmp_path, TABLE, ["| stale |", "|---|"])
    assert refresh_readme.main(["--check"], root=root) == 1  # the README is current; docs/results.md is not
    assert "| stale |" in (root / "docs" / "results.md").read_text(encoding="utf-8")  # --check writes nothing
    assert refresh_readme.main([], root=root) == 0
    assert (root / "docs" / "results.md").read_text(encoding="utf-8") == "\n".join([MARKER, *TABLE, "", "more"])
    assert refresh_readme.main(["--check"], root=root) == 0
