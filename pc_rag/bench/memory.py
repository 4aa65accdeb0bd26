"""``pc-rag bench memory``: bytes per cached token for each storage dtype and CacheGen level, in memory and on disk.

In memory a token's KV is ``layers x 2 x kv_heads x head_dim`` elements (a compressed chunk is decoded
to the model's KV dtype). On disk it is what a real store writes: a small store is built per dtype or
codec level from the bundled sample passages and its KV shards are measured, headers, scales and exact
tokens included (the store's one table file is not: it does not grow with the store). This module
knows nothing about serving.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.kv import kv_shape
from pc_rag.rag.engine import RagEngine
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.embeddings import as_embedder
from pc_rag.store.files import SHARD_DIR


@dataclass
class FootprintRow:
    dtype: str
    memory_bytes_per_token: int
    disk_bytes_per_token: float
    tokens: int
    codec: str = "raw"  # or "cachegen:LEVEL"


def kv_footprint(
    engine: RagEngine, dtypes: list[torch.dtype], documents: int = 20, levels: list[int] = ()
) -> list[FootprintRow]:  # fmt: skip
    """Measure each storage dtype, then each CacheGen level (the model's tables needed), on the first
    ``documents`` sample passages."""
    layers, heads, head_dim = kv_shape(engine.lm.model)
    texts = [f"{title}\n{text}" for q in sample_questions() for title, text in q.passages][:documents]
    settings = [(dtype, None) for dtype in dtypes] + [(engine.kv_dtype, f"cachegen:{n}") for n in levels]
    rows = []
    for dtype, codec in settings:
        with tempfile.TemporaryDirectory() as tmp:
            # embeddings play no part in the KV footprint: a constant embedder keeps the measurement model-only
            embedder = as_embedder(lambda batch: [[1.0, 0.0] for _ in batch], name="constant")
            directory = Path(tmp) / "store"
            store = DocumentStore.create(directory, engine, embedder=embedder, storage_dtype=dtype, codec=codec)
            store.add_documents(texts, progress=False)
            tokens = sum(c.n_tokens for c in store.manifest.chunks.values())
            disk = sum(p.stat().st_size for p in (directory / SHARD_DIR).glob("*.safetensors"))
        per_token = layers * 2 * heads * head_dim * torch.empty(0, dtype=dtype).element_size()
        rows.append(FootprintRow(str(dtype).removeprefix("torch."), per_token, disk / tokens, tokens, codec or "raw"))
    return rows


def format_rows(rows: list[FootprintRow]) -> str:
    lines = [f"{'codec':<11} {'dtype':<9} {'memory B/token':>15} {'disk B/token':>13} {'tokens':>7}"]
    for r in rows:
        lines.append(
            f"{r.codec:<11} {r.dtype:<9} {r.memory_bytes_per_token:>15,} {r.disk_bytes_per_token:>13,.0f} {r.tokens:>7}"
        )
    return "\n".join(lines)
