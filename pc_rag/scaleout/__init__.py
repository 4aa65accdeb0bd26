"""Scale-out on existing engines: encode a corpus with a pool of Ray actors into a shared module store.

Needs ``ray`` (``pip install 'pc-rag[scaleout]'``); imported on use.
"""

from __future__ import annotations

from pc_rag._lazy import lazy_exports

_EXPORTS = {
    "EncoderSpec": "pc_rag.scaleout.encoder_spec",
    "RayChunkWorkers": "pc_rag.scaleout.ray_workers",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
