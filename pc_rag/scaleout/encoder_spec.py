"""What a worker needs to encode chunks exactly as a store would: plain, JSON-able fields, so a worker on any
machine rebuilds the engine and the module writer from them and checks it loaded the same model."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from pc_rag.errors import StoreError
from pc_rag.store.embeddings import SentenceTransformerEmbedder
from pc_rag.store.module_kv import ModuleKV

if TYPE_CHECKING:
    from pc_rag.store.document_store import DocumentStore


@dataclass(frozen=True)
class EncoderSpec:
    """A store's encoding: model (name, compute dtype, fingerprint), prompt, mode, KV storage dtype, codec
    (tables digest and levels), the module store's address and, when workers embed, the embedder's name."""

    model: str
    compute_dtype: str
    model_fingerprint: str
    prompt: dict[str, str]
    mode: str
    storage_dtype: str
    codec_digest: str
    codec_levels: tuple[int, ...]
    modules: str
    encoding: dict[str, Any]
    embedder: dict[str, Any] | None  # SentenceTransformerEmbedder arguments (path, name, normalize), or None

    @classmethod
    def of(cls, store: DocumentStore, modules: str | None = None) -> EncoderSpec:
        """The spec of ``store`` (whose KV must live in a module store; ``modules`` overrides its address as the
        workers see it). Workers embed too when the store's embedder is a sentence-transformers model they can load
        by path; otherwise the driver embeds."""
        kv = store.kv
        if not isinstance(kv, ModuleKV):
            msg = f"the store at {store.directory} keeps its KV in local shards: workers need a module store"
            raise StoreError(msg)
        lm = store.engine.lm
        by_path = isinstance(store.embedder, SentenceTransformerEmbedder)
        return cls(
            model=lm.name, compute_dtype=lm.compute_dtype, model_fingerprint=kv.fingerprint,
            prompt=asdict(store.engine.prompt), mode=store.mode, storage_dtype=str(kv.dtype).removeprefix("torch."),
            codec_digest=kv.codec.tables.digest if kv.codec else "", codec_levels=kv.levels,
            modules=modules or kv.modules.url, encoding=asdict(kv.encoding),
            embedder=_embedder_args(store.embedder) if by_path else None,
        )  # fmt: skip


def _embedder_args(embedder: Any) -> dict[str, Any]:
    return {"path": embedder.path, "name": embedder.name, "normalize": embedder.normalize}
