"""Where a model's fitted splice adapter, attention calibration, CacheGen tables and stock phrases live; loading on
first use.

All are keyed by the model fingerprint: ``<fingerprint>.safetensors`` (adapter),
``<fingerprint>.calibration.json``, ``<fingerprint>.cachegen.safetensors`` (CacheGen tables) and
``<fingerprint>.phrases.json`` (``pc-rag tune-phrases``: a second source of speculative drafts), looked
up first in ``$PC_RAG_CACHE/tuned/`` (what ``pc-rag tune`` and ``pc-rag tune-codec`` write) and then in
the package (``pc_rag/data/tuned/``, shipped for the bundled model). A mode that needs one that does
not exist fails with a message saying how to make it. This module knows nothing about serving.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from pc_rag.calibration import Calibration
from pc_rag.errors import PCRagError
from pc_rag.model import LoadedModel, cache_dir
from pc_rag.rag.adapter import AdapterError, SpliceAdapter

if TYPE_CHECKING:
    from pc_rag.runtime.answer_phrases import AnswerPhrases

logger = logging.getLogger(__name__)

PACKAGED = Path(__file__).resolve().parent.parent / "data" / "tuned"


def tuned_dirs() -> list[Path]:
    """Directories searched in order: the user's cache, then the package."""
    return [cache_dir() / "tuned", PACKAGED]


def adapter_file(fingerprint: str) -> Path:
    return Path(f"{fingerprint}.safetensors")


def calibration_file(fingerprint: str) -> Path:
    return Path(f"{fingerprint}.calibration.json")


def codec_tables_file(fingerprint: str) -> Path:
    return Path(f"{fingerprint}.cachegen.safetensors")


def phrases_file(fingerprint: str) -> Path:
    return Path(f"{fingerprint}.phrases.json")


PHRASES_SWITCH = "PC_RAG_ANSWER_PHRASES"
"""``0`` drafts from the request's own tokens only (no stock phrases)."""


def find_phrases(lm: LoadedModel) -> Path | None:
    """The stock-phrase table serving finds for ``lm`` (its own fingerprint, else that of the float32 weights it was
    quantized from; user cache first, then the package), or None."""
    return next(filter(None, (_installed(phrases_file(f)) for f in lm.fitted_fingerprints())), None)


_PHRASES_LOCK = threading.Lock()


def use_answer_phrases(lm: LoadedModel) -> AnswerPhrases | None:
    """Give ``lm``'s runner its stock phrases (once per model; ``PC_RAG_ANSWER_PHRASES=0`` leaves none): speculative
    steps then also draft them. A broken file is logged and skipped: drafts are only proposals."""
    from pc_rag.runtime.answer_phrases import AnswerPhrases, PhrasesError  # stores load this module, not the runtime
    from pc_rag.runtime.model_runner import ModelRunner

    runner = ModelRunner.of(lm.model)
    with _PHRASES_LOCK:
        if runner.answer_phrases is None and os.environ.get(PHRASES_SWITCH, "1") != "0":
            path = find_phrases(lm)
            if path is not None:
                try:
                    runner.answer_phrases = AnswerPhrases.load(path)
                except PhrasesError as error:
                    logger.warning("stock phrases not used: %s", error)
        return runner.answer_phrases


def _installed(name: Path) -> Path | None:
    """The first file called ``name`` in ``tuned_dirs`` (user cache first, then the package), or None."""
    return next((d / name for d in tuned_dirs() if (d / name).is_file()), None)


def installed_adapter(fingerprint: str) -> Path | None:
    """The adapter serving finds for the model ``fingerprint`` (user cache first, then the package), or None."""
    return _installed(adapter_file(fingerprint))


def find_codec_tables(fingerprint: str) -> Path | None:
    """The CacheGen tables fitted for the model ``fingerprint`` (user cache first, then the package), or None."""
    return _installed(codec_tables_file(fingerprint))


_MERGED: weakref.WeakKeyDictionary[nn.Module, tuple[Path, int, SpliceAdapter]] = weakref.WeakKeyDictionary()
_MERGED_LOCK = threading.Lock()


def find_adapter(lm: LoadedModel) -> Path | None:
    """The adapter serving finds for ``lm``: one fitted for its own weights, else (int8, int4) one fitted for the
    float32 weights it was quantized from (``LoadedModel.fitted_fingerprints``); None if neither exists."""
    return next(filter(None, map(installed_adapter, lm.fitted_fingerprints())), None)


def find_tables(lm: LoadedModel) -> Path | None:
    """The CacheGen tables serving finds for ``lm``: fitted for its own weights, else (int8, int4) for the float32
    weights it was quantized from; None if neither exists."""
    return next(filter(None, map(find_codec_tables, lm.fitted_fingerprints())), None)


def merged_adapter(lm: LoadedModel, path: Path, fingerprint: str | tuple[str, ...]) -> SpliceAdapter:
    """The adapter at ``path`` merged into ``lm``'s layers, once per model: every engine on one model serves
    through the same merged copy (a layer holds one merged adapter). Another file, or this one rewritten since
    (``pc-rag tune``), is refused while the model serves the first: engines already made would change."""
    stamp = path.stat().st_mtime_ns
    with _MERGED_LOCK:
        found = _MERGED.get(lm.model)
        if found is not None and found[:2] == (path, stamp):
            return found[2]
        if found is not None:
            msg = (
                f"this model already serves the splice adapter {found[0]} as it was when first loaded; "
                f"{path} is another file or was rewritten since: load the model again to serve it"
            )
            raise AdapterError(msg)
        adapter = SpliceAdapter.load(path, lm.model, fingerprint).attach(merged=True)
        _MERGED[lm.model] = (path, stamp, adapter)
        return adapter


class Tuned:
    """A model's adapter and calibration, found and loaded once, on first use (thread-safe)."""

    def __init__(self, lm: LoadedModel) -> None:
        self.lm = lm
        self._lock = threading.Lock()
        self._adapter: SpliceAdapter | None = None
        self._calibration: Calibration | None = None

    def use(self, adapter: SpliceAdapter | None = None, calibration: Calibration | None = None) -> None:
        """Serve with these instead of looking them up (the adapter is attached to the model as hooks, so
        it may still be trained; a looked-up adapter is frozen and merged)."""
        with self._lock:
            if adapter is not None:
                if self._adapter is not None and self._adapter is not adapter:
                    self._adapter.detach()
                self._adapter = adapter.attach()
            if calibration is not None:
                self._calibration = calibration

    def adapter(self) -> SpliceAdapter:
        with self._lock:
            if self._adapter is None:
                path = find_adapter(self.lm) or self._find(adapter_file(self.fingerprint()), "splice adapter")
                self._adapter = merged_adapter(self.lm, path, self.lm.fitted_fingerprints())
            return self._adapter

    def has_adapter(self) -> bool:
        """Whether ``adapter`` will find one (given to ``use``, or a file for this model's fingerprint)."""
        with self._lock:
            if self._adapter is not None:
                return True
        return find_adapter(self.lm) is not None

    def calibration(self) -> Calibration:
        with self._lock:
            if self._calibration is None:
                path = self._find(calibration_file(self.fingerprint()), "attention calibration")
                self._calibration = Calibration.load(path, self.fingerprint())
            return self._calibration

    def fingerprint(self) -> str:
        return self.lm.fingerprint()

    def _find(self, name: Path, what: str) -> Path:
        found = _installed(name)
        if found is not None:
            return found
        searched = ", ".join(str(d) for d in tuned_dirs())
        msg = (
            f"no {what} for model {self.lm.name!r} (fingerprint {self.fingerprint()}) in {searched}; "
            "make one with `pc-rag tune` and serve it with `pc-rag tune --install FILE`, or choose a mode without it"
        )
        raise PCRagError(msg)
