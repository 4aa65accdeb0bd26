"""``pc-rag index``, ``ask`` and ``demo``: the document-store jobs behind the CLI.

These functions validate input before anything is written, print results for a
person, and leave every decision about serving to the store and the engine.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from pc_rag.errors import PCRagError, StoreError
from pc_rag.model import LoadedModel
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.ingest import read_documents
from pc_rag.store.manifest import MANIFEST_NAME

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def engine_for(lm: LoadedModel) -> RagEngine:
    """The engine every CLI store uses: LongBench's multi-document QA prompt."""
    return RagEngine(lm, RagPrompt.longbench())


def index(lm: LoadedModel, paths: list[str], store_dir: Path, *, chunk_tokens: int, overlap: int, mode: str,
          index_kind: str, dtype: str, limit: int | None) -> None:  # fmt: skip
    """Read ``paths`` (all of them, before writing), then add them to the store at ``store_dir``."""
    docs = read_documents(paths)[:limit]
    engine = engine_for(lm)
    start = time.perf_counter()
    if (store_dir / MANIFEST_NAME).exists():
        store = DocumentStore.load(store_dir, engine)
    else:
        store = DocumentStore.create(
            store_dir, engine, chunk_tokens=chunk_tokens, overlap_tokens=overlap, mode=mode,
            index_kind=index_kind, storage_dtype=DTYPES[dtype],
        )  # fmt: skip
    before = len(store)
    store.add_documents([(d.text, d.metadata) for d in docs], ids=[d.id for d in docs])
    seconds = time.perf_counter() - start
    tokens = sum(store.manifest.chunks[c].n_tokens for d in docs for c in store.manifest.docs[d.id].chunk_ids)
    size = sum(f.stat().st_size for f in store_dir.rglob("*") if f.is_file())
    print(f"indexed {len(docs)} documents: {len(store) - before} new chunks, {tokens} tokens in {seconds:.1f} s "
          f"({tokens / seconds:.0f} tokens/s); store {len(store)} chunks, {size / 2**20:.1f} MiB on disk")  # fmt: skip


def ask(lm: LoadedModel, store_dir: Path, question: str, *, k: int, mode: str | None, compare_full: bool,
        max_new_tokens: int) -> None:  # fmt: skip
    """Answer ``question`` from the store; print the answer, its sources and TTFT (and full prefill's)."""
    if not question.strip():
        msg = "the question is empty"
        raise PCRagError(msg)
    store = DocumentStore.load(store_dir, engine_for(lm))
    if k > len(store):
        msg = f"k={k} is larger than the store ({len(store)} chunks)"
        raise StoreError(msg)
    answer = store.answer(question, k=k, mode=mode, max_new_tokens=max_new_tokens)
    print(answer.text.strip())
    print("\nsources:")
    for h in answer.sources:
        print(
            f"  [{h.score:.3f}] {h.doc_id} {h.metadata.get('title') or h.metadata.get('source', '')}: {h.text[:80]!r}"
        )
    stats = answer.result.stats
    print(
        f"\nTTFT {stats.ttft_ms:.0f} ms cached ({stats.cached_tokens} cached, {stats.computed_tokens} computed tokens)"
    )
    if compare_full:
        full = store.answer_full(question, k=k, max_new_tokens=max_new_tokens)
        print(f"TTFT {full.result.stats.ttft_ms:.0f} ms full prefill; full prefill answered: {full.text.strip()!r}")


def demo(lm: LoadedModel, questions: int) -> None:
    """Build a store from the bundled HotpotQA sample, then answer sample questions cached and by full prefill."""
    from pc_rag.sample import sample_questions

    sample = sample_questions()[: max(questions, 10)]  # the asked questions' passages plus other questions' as noise
    with tempfile.TemporaryDirectory(prefix="pc-rag-demo-") as tmp:
        print(f"building a store from {sum(len(q.passages) for q in sample)} bundled HotpotQA passages ...")
        store = DocumentStore.create(Path(tmp) / "store", engine_for(lm))
        docs = {f"{t}\n{x}": {"title": t} for q in sample for t, x in q.passages}
        store.add_documents(list(docs.items()))
        print(f"{'question':<58} {'cached':>8} {'full':>8}  answer (cached | full) [gold]")
        for q in sample[:questions]:
            cached = store.answer(q.question, k=5, max_new_tokens=24)
            full = store.answer_full(q.question, k=5, max_new_tokens=24)
            print(f"{q.question[:58]:<58} {cached.result.stats.ttft_ms:>6.0f}ms {full.result.stats.ttft_ms:>6.0f}ms  "
                  f"{cached.text.strip()!r} | {full.text.strip()!r} [{q.answers[0]}]")  # fmt: skip
