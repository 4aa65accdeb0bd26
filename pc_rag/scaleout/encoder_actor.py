"""The stateful worker of distributed encoding: loads the model once, then encodes batches of chunks into the
module store and embeds them. Runs in a Ray actor, but knows nothing about Ray: a batch is a dict of columns.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pc_rag.codec import CacheGenCodec
from pc_rag.errors import StoreMismatchError
from pc_rag.model import load_model
from pc_rag.modules.keys import Encoding
from pc_rag.modules.open_store import open_module_store
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.rag.modes import resolve_mode
from pc_rag.scaleout.encoder_spec import EncoderSpec
from pc_rag.store.chunk_encoding import module_text
from pc_rag.store.codec_setup import model_tables
from pc_rag.store.embeddings import SentenceTransformerEmbedder
from pc_rag.store.kvstore import STORAGE_DTYPES
from pc_rag.store.manifest import Manifest
from pc_rag.store.module_kv import ModuleKV


class ChunkEncoder:
    """Encodes the rows of a batch marked ``encode`` into the spec's module store; returns each row's
    ``chunk_id`` and, when the spec names an embedder, its ``vector``."""

    def __init__(self, spec: dict[str, Any], threads: int = 1) -> None:
        torch.set_num_threads(threads)
        self.spec = EncoderSpec(**{**spec, "codec_levels": tuple(spec["codec_levels"])})
        lm = load_model(self.spec.model, dtype=self.spec.compute_dtype)
        fingerprint = lm.fingerprint()
        if fingerprint != self.spec.model_fingerprint:
            msg = (f"worker loaded {self.spec.model} as model {fingerprint}, but the store was built with "
                   f"{self.spec.model_fingerprint}: install the same weights on every node")  # fmt: skip
            raise StoreMismatchError(msg, {"model_fingerprint": (self.spec.model_fingerprint, fingerprint)})
        self.engine = RagEngine(lm, RagPrompt(**self.spec.prompt))
        self.conditioned = resolve_mode(self.spec.mode).conditioned
        encoding = Encoding(**self.spec.encoding)
        self.encoder = encoding.encoder  # the store's chunk encoder: this node's adapter must have it, or it refuses
        codec = None
        if self.spec.codec_levels:  # the tables installed with pc-rag on this node, as the store's
            tables = model_tables(lm.fitted_fingerprints())[1]
            if tables.digest != self.spec.codec_digest:
                msg = f"worker has CacheGen tables {tables.digest}; the store writes with {self.spec.codec_digest}"
                raise StoreMismatchError(msg, {"codec": (self.spec.codec_digest, tables.digest)})
            codec = CacheGenCodec(tables)
        storage = STORAGE_DTYPES[self.spec.storage_dtype]
        self.writer = ModuleKV(
            open_module_store(self.spec.modules), Manifest(), fingerprint, encoding,
            dtype=storage, compute_dtype=lm.dtype, codec=codec, levels=self.spec.codec_levels, lru_bytes=0,
        )  # fmt: skip
        self.embedder = SentenceTransformerEmbedder(**self.spec.embedder) if self.spec.embedder else None

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        texts = [str(t) for t in batch["text"]]
        todo = [i for i, flag in enumerate(batch["encode"]) if flag]
        if todo:
            ids = [[int(t) for t in batch["token_ids"][i]] for i in todo]
            texts_todo = [module_text(texts[i]) for i in todo]
            encoded = self.engine.encode_token_ids(ids, self.conditioned, texts_todo, encoder=self.encoder)
            self.writer.put_many({str(batch["content_hash"][i]): c.kv for i, c in zip(todo, encoded, strict=True)})
        out = {"chunk_id": np.asarray(batch["chunk_id"], dtype=np.int64)}
        if self.embedder is not None:
            out["vector"] = self.embedder.embed_documents(texts)
        return out
