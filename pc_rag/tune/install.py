"""``pc-rag tune --install FILE`` and ``pc-rag tune --restore``: which splice adapter serving finds.

``tune`` never writes where serving looks; it writes a new file and a report that validates both the new
adapter and the one installed at the time on the same held-out pairs. ``install`` copies the file to the
user cache (``$PC_RAG_CACHE/tuned/<fingerprint>.safetensors``, with its calibration if it has one) only when
that report shows it beat the adapter installed now; ``restore`` removes the user cache's copy, so the
shipped adapter (``pc_rag/data/tuned/``) serves again. This module knows nothing about training.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from pc_rag.errors import PCRagError
from pc_rag.rag.tuned import PACKAGED, adapter_file, calibration_file, installed_adapter, tuned_dirs
from pc_rag.store._atomic import atomic_write, sha256_file
from pc_rag.tune.command import calibration_beside


@dataclass(frozen=True)
class Installed:
    """What ``install`` did: the adapter now served, and the held-out mean KL of it and of the one it replaced."""

    path: Path
    mean_kl: float
    replaced: Path | None
    replaced_kl: float | None


def install(candidate: Path) -> Installed:
    """Install the adapter at ``candidate`` after checking its report (``<candidate>.json``, written by ``tune``).

    ``PCRagError`` when the report is missing, the adapter installed now is not the one it was compared with,
    or the candidate was not better than it on the held-out pairs (lower mean KL against full prefill).
    """
    report = _report(candidate)
    if "installed" not in report:
        msg = f"{candidate.with_suffix('.json')} has no comparison with the installed adapter: train it again"
        raise PCRagError(msg)
    fingerprint, best, before = report["fingerprint"], report["best"], report["installed"]
    current = installed_adapter(fingerprint)
    if (None if current is None else sha256_file(current)) != (None if before is None else before["sha256"]):
        was = "no adapter" if before is None else f"{before['path']} (sha256 {before['sha256'][:12]})"
        now = "none" if current is None else str(current)
        msg = (f"{candidate} was compared with {was}, but serving now finds {now}: train again (pc-rag tune) so "
               "the new adapter is compared with the one it would replace")  # fmt: skip
        raise PCRagError(msg)
    if before is not None and best["mean_kl"] >= before["mean_kl"]:
        msg = (f"not installed: {candidate} is no better than the installed {before['path']} on the held-out pairs "
               f"(mean KL against full prefill {best['mean_kl']:.4f}, installed {before['mean_kl']:.4f})")  # fmt: skip
        raise PCRagError(msg)
    target = tuned_dirs()[0] / adapter_file(fingerprint)
    _copy(candidate, target)
    calibration = calibration_beside(candidate)
    if calibration.is_file():
        _copy(calibration, target.parent / calibration_file(fingerprint))
    replaced = None if before is None else Path(before["path"])
    return Installed(target, best["mean_kl"], replaced, None if before is None else before["mean_kl"])


def restore(fingerprint: str) -> tuple[list[Path], Path | None]:
    """Remove the user cache's adapter and calibration for ``fingerprint``; return what was removed and the
    adapter serving finds now (the shipped one, or None)."""
    user = tuned_dirs()[0]
    removed = [p for p in (user / adapter_file(fingerprint), user / calibration_file(fingerprint)) if p.is_file()]
    for path in removed:
        path.unlink()
    now = installed_adapter(fingerprint)
    assert now is None or now.parent == PACKAGED, now
    return removed, now


def _report(candidate: Path) -> dict:
    if not candidate.is_file():
        msg = f"--install {candidate}: no such adapter file"
        raise PCRagError(msg)
    path = candidate.with_suffix(".json")
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
        float(report["best"]["mean_kl"]), str(report["fingerprint"])  # the fields install reads
    except (OSError, ValueError, KeyError, TypeError) as e:
        msg = f"--install {candidate}: its report {path} (pc-rag tune writes it beside) is missing or unreadable ({e})"
        raise PCRagError(msg) from e
    return report


def _copy(source: Path, target: Path) -> None:
    with source.open("rb") as f:
        atomic_write(target, lambda out: shutil.copyfileobj(f, out))
