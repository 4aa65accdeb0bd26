"""An encoder actor that dies once, the first time any actor has written a batch's modules (a marker file
shared by all actors records that it happened), as a killed machine or OOM-killed process would."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pc_rag.scaleout.encoder_actor import ChunkEncoder

MARKER_ENV = "PC_RAG_TEST_DIED_MARKER"


class DyingEncoder(ChunkEncoder):
    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = super().__call__(batch)  # the modules are written ...
        marker = Path(os.environ[MARKER_ENV])
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return out
        os._exit(1)  # ... and the actor dies before returning its batch
