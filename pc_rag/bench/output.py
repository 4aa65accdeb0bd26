"""What every ``pc-rag bench`` writes with ``--json``: its rows as a JSON list."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path


def write_json(rows: Sequence[object], path: Path) -> None:
    """Benchmark rows (dataclasses) as a JSON list."""
    path.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")  # type: ignore[call-overload]
