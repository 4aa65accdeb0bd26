"""Present aggregated rows: a text table, a JSON file and an F1-vs-TTFT PNG plot.

This module knows nothing about how the rows were measured; matplotlib is imported only when a plot is
drawn (install ``pc-rag[eval]``).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pc_rag.errors import EvalError
from pc_rag.eval.metrics import ALL, ResultRow

_COLUMNS = (  # header, width, cell
    ("dataset", 10, lambda r: r.dataset),
    ("mode", 10, lambda r: r.mode),
    ("n", 5, lambda r: f"{r.n}"),
    ("F1", 6, lambda r: f"{r.f1:.2f}"),
    ("agree", 6, lambda r: f"{r.agreement:.3f}"),
    ("tok1", 6, lambda r: f"{r.first_token_agreement:.3f}"),
    (
        "tok1~The",
        8,
        lambda r: "-" if r.first_token_agreement_non_the is None else f"{r.first_token_agreement_non_the:.3f}",
    ),
    ("KL", 8, lambda r: f"{r.first_token_kl:.4f}"),
    ("ttft p50", 9, lambda r: f"{r.ttft_ms_median:.1f}"),
    ("ttft p90", 9, lambda r: f"{r.ttft_ms_p90:.1f}"),
    ("ctx tok", 8, lambda r: f"{r.context_tokens_mean:.0f}"),
)


def format_table(rows: Sequence[ResultRow]) -> str:
    """A fixed-width table, one line per (dataset, mode); F1 x100, shares in [0, 1], KL in nats, TTFT in ms.

    ``tok1`` is first-token agreement with full prefill, ``tok1~The`` the same without questions whose
    full answer starts with "The".
    """
    lines = [" ".join(f"{h:>{w}}" for h, w, _ in _COLUMNS)]
    lines += [" ".join(f"{cell(r):>{w}}" for _, w, cell in _COLUMNS) for r in rows]
    return "\n".join(lines)


def results_json(rows: Sequence[ResultRow], config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{"results": [row, ...]}`` with every ``ResultRow`` field, plus ``"config"`` when given."""
    out: dict[str, Any] = {"results": [asdict(r) for r in rows]}
    if config is not None:
        out["config"] = dict(config)
    return out


def write_json(rows: Sequence[ResultRow], path: str | Path, config: Mapping[str, Any] | None = None) -> None:
    """Write ``results_json(rows, config)`` to ``path``."""
    Path(path).write_text(json.dumps(results_json(rows, config), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def require_matplotlib() -> None:
    """Raise ``EvalError`` with the install command when matplotlib is missing (call before a long run)."""
    if importlib.util.find_spec("matplotlib") is None:
        msg = "plotting needs matplotlib: pip install 'pc-rag[eval]'"
        raise EvalError(msg)


def plot(rows: Sequence[ResultRow], path: str | Path, title: str = "F1 vs time to first token") -> None:
    """Save a PNG of F1 against median TTFT (log x), one labelled marker per mode, from the ``"all"`` rows."""
    require_matplotlib()
    from matplotlib.figure import Figure  # a bare Figure renders with Agg and leaves pyplot's state alone

    points = [r for r in rows if r.dataset == ALL]
    if not points:
        msg = "nothing to plot: no 'all' rows"
        raise EvalError(msg)
    fig = Figure(figsize=(6, 4.5), dpi=120)
    ax = fig.add_subplot()
    markers = "osD^v<>pP*Xh"
    for i, r in enumerate(points):
        ax.scatter([r.ttft_ms_median], [r.f1], marker=markers[i % len(markers)], s=60, label=r.mode, zorder=3)
        ax.annotate(r.mode, (r.ttft_ms_median, r.f1), textcoords="offset points", xytext=(6, 4), fontsize=8)
    ax.set_xscale("log")
    ax.margins(x=0.15, y=0.12)  # room for the labels of the outermost markers
    ax.set_xlabel("median time to first token (ms, log scale)")
    ax.set_ylabel("F1 (LongBench qa_f1_score x100)")
    ax.set_title(f"{title} (n={points[0].n} per mode)" if len({r.n for r in points}) == 1 else title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(Path(path), format="png")
