"""``ChunkWorkers`` on Ray: a Ray Data ``map_batches`` over a pool of ``ChunkEncoder`` actors (one model load
each, one CPU each), writing modules to the store's module store and returning vectors to the driver, which
builds the FAISS index and commits the manifest.

An actor that dies is restarted and its batch retried (Ray's ``max_restarts`` / ``max_task_retries``); a module
written twice is the same bytes under the same key, and the driver refuses a result that lacks a chunk or
repeats one. ``address`` is a running cluster (``ray://host:10001``, ``auto``) or None for one on this machine.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import TypeVar

import numpy as np

from pc_rag.errors import PCRagError, StoreError
from pc_rag.scaleout.encoder_actor import ChunkEncoder
from pc_rag.scaleout.encoder_spec import EncoderSpec
from pc_rag.store.chunk_encoding import NewChunk
from pc_rag.store.embeddings import Embedder

E = TypeVar("E", bound=BaseException)


class RayChunkWorkers:
    """Encode and embed with ``actors`` single-thread Ray actors; ``embedder`` embeds in the driver when the
    spec names none (an embedder the workers cannot rebuild by path). ``encoder`` is the actor class (a subclass
    may wrap each batch, e.g. to record or inject failures)."""

    def __init__(
        self, spec: EncoderSpec, *, actors: int = 2, address: str | None = None, batch_size: int = 16,
        embedder: Embedder | None = None, threads_per_actor: int = 1, max_retries: int = 3,
        encoder: type[ChunkEncoder] = ChunkEncoder,
    ) -> None:  # fmt: skip
        if spec.embedder is None and embedder is None:
            raise ValueError("the spec names no embedder for the workers: pass one for the driver")
        self.spec, self.actors, self.address, self.batch_size = spec, actors, address, batch_size
        self.embedder, self.threads, self.max_retries, self.encoder = embedder, threads_per_actor, max_retries, encoder

    def run(self, chunks: Sequence[NewChunk]) -> dict[int, np.ndarray]:
        try:
            import ray
        except ImportError as e:
            raise StoreError("indexing on Ray needs ray: pip install 'pc-rag[scaleout]'") from e
        if not chunks:
            return {}
        if not ray.is_initialized():
            ray.init(address=self.address, log_to_driver=False, configure_logging=False)
        ray.data.DataContext.get_current().raise_original_map_exception = True  # an actor's own error, not Ray's
        rows = [{**asdict(c), "token_ids": list(c.token_ids)} for c in chunks]
        data = ray.data.from_items(rows, override_num_blocks=max(1, -(-len(rows) // self.batch_size)))
        encoded = data.map_batches(
            self.encoder, fn_constructor_kwargs={"spec": asdict(self.spec), "threads": self.threads},
            batch_size=self.batch_size, batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=self.actors),
            num_cpus=self.threads,
            max_restarts=self.max_retries, max_task_retries=self.max_retries,
        )  # fmt: skip
        try:
            out = encoded.take_all()
        except Exception as e:  # an actor's own error (unreachable store, wrong model) comes wrapped by Ray
            cause = _pc_rag_cause(e)
            if cause is None:
                raise
            raise with_note(cause, "(raised in a Ray encoder actor; nothing of this part was committed)") from None
        ids = [int(row["chunk_id"]) for row in out]
        if sorted(ids) != sorted(c.chunk_id for c in chunks):
            msg = f"the Ray job returned {len(ids)} results for {len(chunks)} chunks ({len(set(ids))} distinct)"
            raise StoreError(msg)
        if self.spec.embedder is not None:
            return {i: np.asarray(row["vector"], dtype=np.float32) for i, row in zip(ids, out, strict=True)}
        assert self.embedder is not None
        vectors = self.embedder.embed_documents([c.text for c in chunks])
        return {c.chunk_id: v for c, v in zip(chunks, vectors, strict=True)}


def with_note(error: E, note: str) -> E:
    """``error`` with ``note`` added: as a note (``add_note``) from Python 3.11, before that at the end of its
    message (``args[0]``), so the reason is shown either way."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]} {note}", *error.args[1:])
    return error


def _pc_rag_cause(error: BaseException | None) -> PCRagError | None:
    """The first pc-rag error in the chain of causes Ray wraps an actor's exception in, if any."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, PCRagError):
            return error
        seen.add(id(error))
        error = error.__cause__ or getattr(error, "cause", None) or error.__context__
    return None
