"""The model ids an OpenAI client names: ``<model>`` (no retrieval) and, with a store, ``<model>+rag`` (retrieval
with the server's recovery mode) or ``<model>+rag:<mode>`` (any mode ``resolve_mode`` accepts).

This module knows nothing about HTTP or how a request is served: it maps an id to what it asks for.
"""

from __future__ import annotations

from dataclasses import dataclass

from pc_rag.errors import PCRagError
from pc_rag.rag.modes import MODES, is_mode

RAG_SUFFIX = "+rag"


class ModelNotFoundError(PCRagError):
    """A request names a model id this server does not serve (an HTTP server answers 404 ``model_not_found``)."""


@dataclass(frozen=True)
class ModelRoute:
    """What a model id asks for: ``rag`` (retrieve from the store) with ``mode`` (None: the server's)."""

    id: str
    rag: bool = False
    mode: str | None = None


@dataclass(frozen=True)
class ModelIds:
    """The ids of ``model`` served with (``store``) or without a document store."""

    model: str
    store: bool

    def listed(self) -> list[str]:
        """The plain id, then the RAG ids: the server's mode and each named mode that needs no tuned files."""
        if not self.store:
            return [self.model]
        rag = self.model + RAG_SUFFIX
        named = [f"{rag}:{name}" for name, m in MODES.items() if not (m.adapter or m.calibrated)]
        return [self.model, rag, *named]

    def route(self, model_id: str | None) -> ModelRoute:
        """What ``model_id`` asks for (None: the plain model); ``ModelNotFoundError`` for an id not served."""
        if model_id is None or model_id == self.model:
            return ModelRoute(self.model)
        rest = model_id.removeprefix(self.model + RAG_SUFFIX)
        if self.store and rest != model_id:
            if not rest:
                return ModelRoute(model_id, rag=True)
            mode = rest.removeprefix(":")
            if rest.startswith(":") and is_mode(mode):
                return ModelRoute(model_id, rag=True, mode=mode)
        served = ", ".join(self.listed()[:2])
        rag = f", or {self.model}{RAG_SUFFIX}:<mode> (a recovery mode such as prefix or edge:32)" if self.store else ""
        msg = f"the model {model_id!r} does not exist on this server; use {served}{rag} (GET /v1/models lists them)"
        raise ModelNotFoundError(msg)
