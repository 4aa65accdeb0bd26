"""Document store: chunking, embeddings, vector index, persisted chunk KV and the manifest that ties them.

``sentence-transformers`` is imported only when a ``SentenceTransformerEmbedder`` is built.
"""

from pc_rag.store.chunking import ChunkSpan, split_text
from pc_rag.store.embeddings import (
    DEFAULT_EMBEDDER,
    CallableEmbedder,
    CheckedEmbedder,
    Embedder,
    LangChainEmbedder,
    LlamaIndexEmbedder,
    SentenceTransformerEmbedder,
    as_embedder,
)
from pc_rag.store.index import KINDS, IndexConfig, VectorIndex
from pc_rag.store.kvstore import DEFAULT_LRU_BYTES, STORAGE_DTYPES, KVStore
from pc_rag.store.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    ChunkRecord,
    DocRecord,
    Manifest,
    ShardRecord,
    StoreIdentity,
    text_hash,
    tokenizer_hash,
)

__all__ = [
    "DEFAULT_EMBEDDER",
    "DEFAULT_LRU_BYTES",
    "FORMAT_VERSION",
    "KINDS",
    "MANIFEST_NAME",
    "STORAGE_DTYPES",
    "CallableEmbedder",
    "CheckedEmbedder",
    "ChunkRecord",
    "ChunkSpan",
    "DocRecord",
    "Embedder",
    "IndexConfig",
    "KVStore",
    "LangChainEmbedder",
    "LlamaIndexEmbedder",
    "Manifest",
    "SentenceTransformerEmbedder",
    "ShardRecord",
    "StoreIdentity",
    "VectorIndex",
    "as_embedder",
    "split_text",
    "text_hash",
    "tokenizer_hash",
]
