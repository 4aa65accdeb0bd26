"""Where an example's chunks come from: its own passages (closed) or a pooled store (open retrieval).

Closed context is LongBench's: an example's own passages, in order and numbered, are its
chunks. Open retrieval pools every passage of the evaluated examples of a dataset into one
``DocumentStore`` (one chunk per passage, deduplicated by content), retrieves the top ``k`` per
question, lays them out in a chunk order (``pc_rag.rag.order``) and reports which share of the
example's supporting passages was retrieved. Encoding happens here, outside the timed answer.
This module knows nothing about scoring or reports.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from pc_rag.eval.datasets import Example, Passage
from pc_rag.rag.order import BEST_FIRST, check_order, reorder

SETTINGS = ("closed", "open")


class ContextSource(Protocol):
    """What the runner asks for each example and mode."""

    setting: str

    def chunks(self, example: Example, mode: str) -> list[Any]: ...

    def recall(self, example: Example) -> float | None: ...


class ClosedContexts:
    """Each example's own passages, numbered in order, encoded the way each mode wants them."""

    setting = "closed"

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self._example: str | None = None
        self._encoded: dict[tuple[bool, str], list[Any]] = {}

    def chunks(self, example: Example, mode: str) -> list[Any]:
        from pc_rag.rag.modes import resolve_mode

        if self._example != example.id:  # only the current example's encodings are kept
            self._example, self._encoded = example.id, {}
        # modes differ in encoding only by these two: encode once per pair of values
        key = (resolve_mode(mode).conditioned, self.engine.chunk_encoder(mode))
        if key not in self._encoded:
            texts = [self.engine.passage_text(i, p.title, p.text) for i, p in enumerate(example.passages, start=1)]
            self._encoded[key] = self.engine.encode(texts, mode)
        return self._encoded[key]

    def recall(self, example: Example) -> float | None:
        return None


class OpenContexts:
    """Every passage of ``examples`` pooled per dataset in a store under ``directory``; top ``k`` per question.

    One store per dataset and encoding (isolated for ``naive``, after the preamble otherwise; by the
    splice adapter's encoding side for modes that read chunks so encoded), built on first use. Its
    directory is named by what it holds (the pooled passages, the model, the preamble), so a store is
    reused only for the same pool; a build adds passages in parts, each saved, so an interrupted build
    resumes. Each passage is one chunk: the store's chunk size is set above the longest passage.

    The retrieved chunks are laid out in ``order``. The setting label is ``open`` for the ranking
    itself (best first) and ``open:<order>`` otherwise, so orders are told apart in one report and
    state file; the stores do not depend on the order, so every order reuses them.
    """

    build_part = 512  # passages per saved step of a store build

    def __init__(
        self,
        engine: Any,
        examples: Sequence[Example],
        k: int,
        directory: str | Path,
        embedder: object = None,
        order: str = BEST_FIRST,
    ) -> None:
        self.engine, self.k, self.directory, self.embedder = engine, k, Path(directory), embedder
        self.order = check_order(order)
        self.setting = open_setting(order)
        self._pools: dict[str, list[Passage]] = {}
        for example in examples:
            pool = self._pools.setdefault(example.dataset, [])
            pool.extend(example.passages)
        self._stores: dict[tuple[str, bool, str], Any] = {}
        self._retrieved: dict[tuple[str, str], list[Any]] = {}

    def chunks(self, example: Example, mode: str) -> list[Any]:
        from pc_rag.rag.modes import resolve_mode

        resolved = resolve_mode(mode)
        store = self._store(example.dataset, resolved.conditioned, self.engine.chunk_encoder(resolved), resolved.name)
        return store.chunks(reorder(self._handles(example, store), self.order))

    def in_order(self, order: str) -> OpenContexts:
        """These contexts laid out in ``order``, sharing their stores and retrievals."""
        reordered = copy.copy(self)
        reordered.order, reordered.setting = check_order(order), open_setting(order)
        return reordered

    def recall(self, example: Example) -> float | None:
        supporting = {passage_id(p) for p in example.passages if p.is_supporting}
        if not supporting:
            return None
        built = [s for (dataset, *_), s in self._stores.items() if dataset == example.dataset]
        store = built[0] if built else self._store(example.dataset, conditioned=True)
        retrieved = {h.doc_id for h in self._handles(example, store)}
        return len(supporting & retrieved) / len(supporting)

    def _handles(self, example: Example, store: Any) -> list[Any]:
        key = (example.dataset, example.id)  # retrieval does not depend on the encoding: search once, best first
        if key not in self._retrieved:
            self._retrieved[key] = store.search(example.question, self.k)
        return self._retrieved[key]

    def _store(self, dataset: str, conditioned: bool, encoder: str = "", mode: str = "") -> Any:
        """The pooled store of ``dataset`` encoded alone or after the preamble, by the plain model or by the
        encoding side ``encoder`` (for ``mode``, which reads chunks so encoded)."""
        key = (dataset, conditioned, encoder)
        if key not in self._stores:
            unique = {passage_id(p): p for p in self._pools[dataset]}
            encoding = ("conditioned" if conditioned else "isolated") + (f"-{encoder}" if encoder else "")
            path = self.directory / f"{dataset}-{self._pool_digest(unique)}-{encoding}"
            documents = {pid: (passage_text(p), {"title": p.title}) for pid, p in unique.items()}
            if not encoder:
                mode = "prefix" if conditioned else "naive"
            self._stores[key] = pooled_store(path, self.engine, documents, mode, self.embedder, part=self.build_part)
        return self._stores[key]

    def _pool_digest(self, unique: dict[str, Passage]) -> str:
        """A short name for a pool under this model and preamble: a different pool or model gets its own store."""
        digest = hashlib.sha256(f"{self.engine.lm.fingerprint()}\x00{self.engine.prompt.digest()}".encode())
        digest.update("\n".join(sorted(unique)).encode())
        return digest.hexdigest()[:12]


def pooled_store(
    path: Path,
    engine: Any,
    documents: dict[str, tuple[str, dict[str, Any]]],
    mode: str,
    embedder: object = None,
    *,
    storage_dtype: Any = None,
    part: int = 512,
) -> Any:
    """The store at ``path`` holding ``documents`` (id -> text, metadata), one chunk each, encoded for ``mode``.

    Created on first use (chunk size above the longest document) or loaded; documents it lacks are
    added with a commit every ``part`` chunks, so an interrupted build resumes.
    """
    from pc_rag.store.document_store import DocumentStore
    from pc_rag.store.manifest import MANIFEST_NAME

    if (path / MANIFEST_NAME).is_file():
        store = DocumentStore.load(path, engine, embedder=embedder)
    else:
        longest = max(len(engine.tokenize(text)) for text, _ in documents.values())
        extra = {} if storage_dtype is None else {"storage_dtype": storage_dtype}
        store = DocumentStore.create(
            path, engine, embedder=embedder, chunk_tokens=longest + 16, overlap_tokens=0, mode=mode, **extra
        )
    missing = [d for d in documents if d not in store.manifest.docs]
    if missing:
        store.add_documents([documents[d] for d in missing], ids=missing, commit_every=part)
    return store


def open_setting(order: str) -> str:
    """The setting label of open retrieval with chunks laid out in ``order``."""
    return "open" if order == BEST_FIRST else f"open:{order}"


def passage_text(passage: Passage) -> str:
    """A pooled passage as its chunk reads: title line, then text (unnumbered: positions vary per question)."""
    return f"{passage.title}\n{passage.text}"


def passage_id(passage: Passage) -> str:
    """A passage's identity across examples: its title and text."""
    return hashlib.sha256(f"{passage.title}\x00{passage.text}".encode()).hexdigest()[:16]
