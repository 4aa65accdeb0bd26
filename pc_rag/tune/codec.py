"""``pc-rag tune-codec``: fit a model's CacheGen tables on passages of the tuning split.

Passages are encoded the way stores encode chunks, alternately alone and after the preamble, so the
tables see both kinds of KV the recovery modes store. The tables are written where stores look for
them (``<fingerprint>.cachegen.safetensors``). This module knows nothing about serving.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from pc_rag.codec import CodecTables, fit_tables
from pc_rag.errors import PCRagError
from pc_rag.eval.datasets import load_examples, tuning_split
from pc_rag.rag.engine import ENCODE_BATCH, RagEngine

DEFAULT_PASSAGES = 200


def fit_codec(
    engine: RagEngine, dataset: Path, passages: int = DEFAULT_PASSAGES, *, progress: bool = True
) -> CodecTables:
    """Tables fitted on the first ``passages`` passages of the tuning split in ``dataset``."""
    split = tuning_split(load_examples(dataset))
    texts = [engine.passage_text(i + 1, p.title, p.text) for e in split for i, p in enumerate(e.passages)][:passages]
    if not texts:
        msg = f"{dataset} holds no passages of the tuning split to fit CacheGen tables on"
        raise PCRagError(msg)
    samples = []
    for start in tqdm(range(0, len(texts), ENCODE_BATCH), desc="encode", unit="batch", disable=not progress):
        batch = texts[start : start + ENCODE_BATCH]
        ids = [engine.tokenize(t) for t in batch]
        chunks = engine.encode_token_ids(ids[::2], conditioned=False) + engine.encode_token_ids(
            ids[1::2], conditioned=True
        )
        samples.extend((c.kv.keys, c.kv.values) for c in chunks)
    return fit_tables(samples, engine.lm.fingerprint())
