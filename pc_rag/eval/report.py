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


def _f1_delta(row: ResultRow) -> str:
    if row.f1_delta is None or row.f1_delta_ci95 is None:
        return "-"
    low, high = row.f1_delta_ci95
    return f"{row.f1_delta:+.2f} [{low:+.2f},{high:+.2f}]"


_COLUMNS = (  # header, width, cell
    ("dataset", 10, lambda r: r.dataset),
    ("mode", 10, lambda r: r.mode),
    ("n", 5, lambda r: f"{r.n}"),
    ("F1", 6, lambda r: f"{r.f1:.2f}"),
    ("dF1 [95% CI]", 21, _f1_delta),
    ("agree", 6, lambda r: f"{r.agreement:.3f}"),
    ("tok1", 6, lambda r: f"{r.first_token_agreement:.3f}"),
    (
        "tok1~The",
        8,
        lambda r: "-" if r.first_token_agreement_non_the is None else f"{r.first_token_agreement_non_the:.3f}",
    ),
    ("KL", 8, lambda r: f"{r.first_token_kl:.4f}"),
    ("tfKL", 8, lambda r: "-" if r.teacher_forced_kl is None else f"{r.teacher_forced_kl:.4f}"),
    ("tfAgr", 6, lambda r: "-" if r.teacher_forced_agreement is None else f"{r.teacher_forced_agreement:.3f}"),
    ("ttft p50", 9, lambda r: f"{r.ttft_ms_median:.1f}"),
    ("ttft p90", 9, lambda r: f"{r.ttft_ms_p90:.1f}"),
    ("ctx tok", 8, lambda r: f"{r.context_tokens_mean:.0f}"),
)


def format_table(rows: Sequence[ResultRow]) -> str:
    """A fixed-width table, one line per (dataset, mode); F1 x100, shares in [0, 1], KL in nats, TTFT in ms.

    ``dF1`` is F1 minus full prefill's on the same questions, with its paired bootstrap 95% interval;
    ``tok1`` is first-token agreement with full prefill, ``tok1~The`` the same without questions whose
    full answer starts with "The"; ``tfKL`` and ``tfAgr`` are KL(full || mode) and next-token agreement
    teacher-forced with full's first answer tokens, averaged over those steps (``-`` for old records);
    ``codecKL``, ``cAgr`` and ``cdF1`` compare a ``<mode>@cachegen:<level>`` or ``<mode>@<dtype>`` row with
    ``<mode>``.
    """
    columns = list(_COLUMNS)
    if len({r.setting for r in rows}) > 1:
        columns.insert(0, ("setting", 7, lambda r: r.setting))
    if any(r.retrieval_recall is not None for r in rows):
        columns.append(("recall", 6, lambda r: "-" if r.retrieval_recall is None else f"{r.retrieval_recall:.3f}"))
    if any(r.codec_kl is not None for r in rows):  # against the same mode on chunks as encoded
        columns += [
            ("codecKL", 8, lambda r: "-" if r.codec_kl is None else f"{r.codec_kl:.4f}"),
            ("cAgr", 6, lambda r: "-" if r.codec_agreement is None else f"{r.codec_agreement:.3f}"),
            ("cdF1", 6, lambda r: "-" if r.codec_f1_delta is None else f"{r.codec_f1_delta:+.2f}"),
        ]
    lines = [" ".join(f"{h:>{w}}" for h, w, _ in columns)]
    lines += [" ".join(f"{cell(r):>{w}}" for _, w, cell in columns) for r in rows]
    return "\n".join(lines)


def results_json(rows: Sequence[ResultRow], config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{"results": [row, ...]}`` with every ``ResultRow`` field (``retrieval_recall`` only in open rows),
    plus ``"config"`` when given."""
    out: dict[str, Any] = {"results": [_row_json(r) for r in rows]}
    if config is not None:
        out["config"] = dict(config)
    return out


def _row_json(row: ResultRow) -> dict[str, Any]:
    data = asdict(row)
    if data["retrieval_recall"] is None:
        del data["retrieval_recall"]
    return data


def write_json(rows: Sequence[ResultRow], path: str | Path, config: Mapping[str, Any] | None = None) -> None:
    """Write ``results_json(rows, config)`` to ``path``."""
    Path(path).write_text(json.dumps(results_json(rows, config), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def require_matplotlib() -> None:
    """Raise ``EvalError`` with the install command when matplotlib is missing (call before a long run)."""
    if importlib.util.find_spec("matplotlib") is None:
        msg = "plotting needs matplotlib: pip install 'pc-rag[eval]'"
        raise EvalError(msg)


def plot(rows: Sequence[ResultRow], path: str | Path, title: str = "Speed vs quality") -> None:
    """Save a PNG from the ``"all"`` rows: F1 and first-token KL to full prefill against median TTFT (log x)."""
    require_matplotlib()
    from matplotlib.figure import Figure  # a bare Figure renders with Agg and leaves pyplot's state alone
    from matplotlib.ticker import NullFormatter

    points = [r for r in rows if r.dataset == ALL]
    if not points:
        msg = "nothing to plot: no 'all' rows"
        raise EvalError(msg)
    several = len({r.setting for r in points}) > 1
    fig = Figure(figsize=(11, 4.5), dpi=120)
    axes = fig.subplots(1, 2)
    panels = (("f1", "F1 (LongBench qa_f1_score x100)"), ("first_token_kl", "first-token KL(full || mode), nats"))
    markers = "osD^v<>pP*Xh"
    for ax, (field, label) in zip(axes, panels, strict=True):
        for i, r in enumerate(points):
            name = f"{r.mode} ({r.setting})" if several else r.mode
            y = getattr(r, field)
            ax.scatter([r.ttft_ms_median], [y], marker=markers[i % len(markers)], s=60, label=name, zorder=3)
            ax.annotate(name, (r.ttft_ms_median, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor log ticks would print overlapping labels
        ax.margins(x=0.15, y=0.12)  # room for the labels of the outermost markers
        ax.set_xlabel("median time to first token (ms, log scale)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    n = {r.n for r in points}
    fig.suptitle(f"{title} (n={n.pop()} per mode)" if len(n) == 1 else title)
    fig.tight_layout()
    fig.savefig(Path(path), format="png")
