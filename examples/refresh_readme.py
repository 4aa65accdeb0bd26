"""Regenerate every table of README.md and docs/*.md that sits under a ``<!-- python examples/results_table.py ... -->``
marker.

    python examples/refresh_readme.py [--check]

Each marker's command is run and its output replaces the block below the marker: the table's ``|`` lines
and, when the command also prints a note after a blank line (``bench link``'s text, ``bench serve``'s second
table), the old note paragraph of the same kind.
``--check`` changes nothing and exits 1 if a table is out of date. This script knows nothing about what a table
means: results_table.py renders it from the committed JSON.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- (python examples/results_table\.py .+?) -->$")


def documents(root: Path) -> list[Path]:
    """The files whose markers are refreshed: README.md and every Markdown file in docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def rendered(command: str, root: Path = ROOT) -> list[str]:
    out = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=root, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return out.rstrip("\n").split("\n")


def old_block(lines: list[str], start: int, new: list[str]) -> int:
    """The end (exclusive) of the block below a marker at ``start``: its table, and its note (a second table, or
    text) if ``new`` has one of the same kind."""
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    notes = [new[i + 1] for i, line in enumerate(new[:-1]) if not line.strip()]  # what follows the blank line
    old_note = end + 1 < len(lines) and not lines[end].strip() and lines[end + 1].strip()
    # a paragraph of another kind (prose under a new note that is a table, or the reverse) is the document's own
    if notes and old_note and lines[end + 1].startswith("|") == notes[0].startswith("|"):
        end += 1
        while end < len(lines) and lines[end].strip():
            end += 1
    return end


def refresh(text: str, render: Callable[[str], list[str]]) -> tuple[str, list[str]]:
    """``text`` with every marked block replaced by ``render(command)``, and the commands whose block changed."""
    lines = text.split("\n")
    out, i, stale = [], 0, []
    while i < len(lines):
        out.append(lines[i])
        match = MARKER.match(lines[i])
        i += 1
        if match:
            new = render(match.group(1))
            end = old_block(lines, i, new)
            if lines[i:end] != new:
                stale.append(match.group(1))
            out += new
            i = end
    return "\n".join(out), stale


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report tables that are out of date")
    args = parser.parse_args(argv)
    any_stale = False
    for path in documents(root):
        if not path.exists():
            continue
        new, stale = refresh(path.read_text(encoding="utf-8"), lambda command: rendered(command, root))
        for command in stale:
            print(f"{'stale' if args.check else 'refreshed'}: {path.relative_to(root)}: {command}")
        any_stale = any_stale or bool(stale)
        if stale and not args.check:
            path.write_text(new, encoding="utf-8")
    return 1 if args.check and any_stale else 0


if __name__ == "__main__":
    sys.exit(main())
