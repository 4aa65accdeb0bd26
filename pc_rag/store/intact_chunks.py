"""Answering around damage: a store's chunks for an answer, without those whose KV fails its checksum.

One damaged chunk should cost an answer that chunk, not the answer: the others are read as usual, the damaged ones
are left out and named, and a warning naming ``pc-rag store repair`` is logged once per chunk and loaded store.
This module knows nothing about prompts or serving: the caller lays out and answers from what it returns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pc_rag.errors import StoreCorruptedError
from pc_rag.rag.chunk import Chunk
from pc_rag.store.handles import ModuleHandle

if TYPE_CHECKING:
    from pc_rag.store.document_store import DocumentStore

logger = logging.getLogger(__name__)


def intact_chunks(
    store: DocumentStore, handles: Sequence[ModuleHandle]
) -> tuple[list[Chunk], tuple[ModuleHandle, ...]]:
    """The chunks of ``handles`` whose KV reads back intact (in the given order), and the handles skipped because
    theirs fails its checksum. ``StoreCorruptedError`` when every one is damaged: there is nothing to answer from."""
    try:
        return store.chunks(handles), ()
    except StoreCorruptedError:
        pass  # read one by one: which are damaged
    chunks: list[Chunk] = []
    skipped: list[ModuleHandle] = []
    last: StoreCorruptedError | None = None
    for handle in handles:
        try:
            chunks.extend(store.chunks([handle]))
        except StoreCorruptedError as e:
            skipped.append(handle)
            last = e
    if not chunks:
        assert last is not None
        raise last
    new = [h for h in skipped if h.chunk_id not in store.warned_damaged]
    if new:
        store.warned_damaged.update(h.chunk_id for h in new)
        names = ", ".join(f"chunk {h.chunk_id} ({h.metadata.get('source') or h.doc_id})" for h in new)
        logger.warning(
            "skipped %s: its KV fails its checksum; answering from the other %d retrieved chunks; "
            "run `pc-rag store repair --store %s`", names, len(chunks), store.directory,
        )  # fmt: skip
    return chunks, tuple(skipped)
