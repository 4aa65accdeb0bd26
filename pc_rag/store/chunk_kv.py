"""Where a document store keeps chunk KV: its own safetensors shards (``KVStore``), or a module store shared
with other processes and machines (``ModuleKV``), chosen when the store is created and recorded in its
manifest."""

from __future__ import annotations

from pathlib import Path

import torch

from pc_rag.codec import CacheGenCodec
from pc_rag.errors import StoreError
from pc_rag.modules.interface import ModuleStore
from pc_rag.modules.keys import Encoding
from pc_rag.modules.open_store import open_module_store
from pc_rag.store.kvstore import KVStore
from pc_rag.store.manifest import Manifest, StoreIdentity
from pc_rag.store.module_kv import ModuleKV

ChunkKV = KVStore | ModuleKV


def module_encoding(identity: StoreIdentity, storage: torch.dtype) -> Encoding:
    """The encoding a store's module keys name: its preamble, chunking, start position, conditioning, chunk
    encoder, dtype."""
    return Encoding(
        preamble_hash=identity.preamble_hash,
        chunk_tokens=identity.chunk_tokens,
        overlap_tokens=identity.overlap_tokens,
        start_position=identity.start_position,
        conditioned=identity.encoding_mode.endswith("/conditioned"),
        storage=str(storage).removeprefix("torch."),
        encoder=identity.chunk_encoder,
    )


def open_chunk_kv(
    directory: Path,
    manifest: Manifest,
    *,
    storage: torch.dtype,
    compute_dtype: torch.dtype,
    lru_bytes: int,
    codec: CacheGenCodec | None,
    modules: str | ModuleStore | None = None,
) -> ChunkKV:
    """The chunk KV of the store ``manifest`` describes: its shards, or the module store it names (``modules``
    overrides the address it was built with, e.g. the same Redis seen from another machine)."""
    if not manifest.modules:
        if modules is not None:
            msg = f"the store at {directory} keeps its KV in its own shards, not in a module store ({modules})"
            raise StoreError(msg)
        return KVStore(directory, dtype=storage, compute_dtype=compute_dtype, lru_bytes=lru_bytes, manifest=manifest,
                       codec=codec, levels=manifest.codec_levels)  # fmt: skip
    backend = open_module_store(modules or manifest.modules) if not isinstance(modules, ModuleStore) else modules
    assert manifest.identity is not None
    return ModuleKV(
        backend, manifest, manifest.identity.model_fingerprint, module_encoding(manifest.identity, storage),
        dtype=storage, compute_dtype=compute_dtype, codec=codec, levels=manifest.codec_levels, lru_bytes=lru_bytes,
    )  # fmt: skip


def open_chunk_shards(kv: ChunkKV) -> list[str]:
    """Verify a store's own shards now (``KVStore.open_shards``), so that no request pays a shard's checksum on
    its first read; a line per shard that cannot be opened. A module store has no shards here: nothing to do."""
    return kv.open_shards() if isinstance(kv, KVStore) else []
