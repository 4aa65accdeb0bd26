"""``pc-rag bench encode``: how fast chunks become stored modules, against the raw batched forward.

The same chunks (the bundled sample's passages, one per chunk, up to 256 tokens) go through:
the model's decoder alone, in the engine's batches (the bound: no KV is kept); the engine's
encoding (after the preamble's KV, each chunk's KV cut out and kept); and a document store's
``add_documents`` (encoding, embeddings, safetensors shards, FAISS, manifest). Tokens per second
are the median of ``runs`` after a warm-up. This module knows nothing about how encoding works.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pc_rag.bench.timing import timed_runs
from pc_rag.errors import PCRagError
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.rag import RagEngine
from pc_rag.rag.engine import ENCODE_BATCH

CHUNK_TOKENS = 256


@dataclass
class EncodeRow:
    path: str
    dtype: str
    tokens: int
    tokens_per_s: float | None
    vs_forward: float | None = None  # this path's throughput over the raw forward's, same dtype
    note: str = ""


def encode_benchmark(engine: RagEngine, runs: int = 3, embedder: object | None = None) -> list[EncodeRow]:
    """Rows for the raw forward, the engine's encoding and a store's ``add_documents``, in ``engine``'s dtype."""
    texts, ids = _chunks(engine)
    tokens = sum(map(len, ids))
    dtype = engine.lm.compute_dtype
    forward = _rate(lambda: _raw_forward(engine, ids), tokens, runs)
    rows = [EncodeRow("raw batched forward (decoder only)", dtype, tokens, forward)]
    rows.append(EncodeRow("engine.encode (KV kept)", dtype, tokens, _rate(lambda: engine.encode(texts), tokens, runs)))
    try:
        store = _rate(lambda: _store_add(engine, texts, embedder), tokens, runs)
        rows.append(EncodeRow("DocumentStore.add_documents (KV, embeddings, files)", dtype, tokens, store))
    except PCRagError as e:
        rows.append(EncodeRow("DocumentStore.add_documents (KV, embeddings, files)", dtype, tokens, None, note=str(e)))
    for row in rows:
        row.vs_forward = row.tokens_per_s / forward if row.tokens_per_s else None
    return rows


def _chunks(engine: RagEngine) -> tuple[list[str], list[list[int]]]:
    passages = dict.fromkeys(engine.passage_text(1, t, b) for q in sample_questions() for t, b in q.passages)
    ids = [engine.tokenize(text)[:CHUNK_TOKENS] for text in passages]
    return [engine.lm.tokenizer.decode(i) for i in ids], ids


@torch.inference_mode()
def _raw_forward(engine: RagEngine, token_ids: Sequence[Sequence[int]]) -> None:
    """The decoder over the same batches the engine makes (sorted by length, right-padded), nothing kept."""
    decoder = engine.lm.model.get_decoder()
    order = sorted(token_ids, key=len)
    for b in range(0, len(order), ENCODE_BATCH):
        batch = order[b : b + ENCODE_BATCH]
        ids = torch.zeros(len(batch), max(map(len, batch)), dtype=torch.long)
        for row, chunk in enumerate(batch):
            ids[row, : len(chunk)] = torch.as_tensor(chunk)
        decoder(input_ids=ids.to(engine.lm.device), use_cache=False)


def _store_add(engine: RagEngine, texts: list[str], embedder: object | None) -> None:
    from pc_rag.store.document_store import DocumentStore

    with (
        tempfile.TemporaryDirectory(prefix="pc-rag-bench-") as directory,
        DocumentStore.create(directory, engine, embedder=embedder, chunk_tokens=CHUNK_TOKENS) as store,
    ):
        store.add_documents(texts, progress=False)


def _rate(run: Callable[[], object], tokens: int, runs: int) -> float:
    return tokens / statistics.median(timed_runs(run, runs))  # after a warm-up: first-touch allocations, embedder


def format_rows(rows: Sequence[EncodeRow]) -> str:
    lines = [f"{'path':<52} {'dtype':>8} {'tokens':>7} {'tokens/s':>9} {'vs forward':>10}"]
    for r in rows:
        rate = f"{r.tokens_per_s:,.0f}" if r.tokens_per_s else "-"
        ratio = f"{r.vs_forward:.0%}" if r.vs_forward else "-"
        lines.append(f"{r.path:<52} {r.dtype:>8} {r.tokens:>7} {rate:>9} {ratio:>10}  {r.note}".rstrip())
    return "\n".join(lines)
