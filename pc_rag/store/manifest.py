"""The JSON manifest of a document store: what built it, which chunks and documents it holds, where their KV lives.

The manifest is the store's single source of truth. It is rewritten whole and
atomically (temp file, fsync, ``os.replace``), so a crash leaves the previous
version. ``StoreIdentity`` records everything cached KV and vectors depend on;
``check_compatible`` refuses a store built under a different one. This module
knows nothing about tensors, FAISS or models: identity values arrive as plain
strings and numbers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shlex
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pc_rag.errors import StoreCorruptedError, StoreError, StoreMismatchError
from pc_rag.store._atomic import atomic_write
from pc_rag.store.files import LEGACY_INDEX_NAME, check_index_name, check_shard_name, check_tables_name
from pc_rag.store.files import MANIFEST_NAME as MANIFEST_NAME  # its home is files.py; re-exported

logger = logging.getLogger(__name__)

FORMAT_VERSION = 6  # 2: versioned index file with a checksum, commit generation; 3: compressed KV shards;
# 4: chunk content hashes, KV in a module store; 5: a checksum per chunk in each shard record (older shard records
# have none and are verified per shard only, until a compaction rewrites them); 6: the identity's chunk_encoder
# (older identities have none: their chunks were encoded by the plain model)


@dataclass(frozen=True)
class StoreIdentity:
    """Everything stored KV and vectors depend on; a store is only valid for an identical identity."""

    model_name: str
    model_fingerprint: str  # LoadedModel.fingerprint()
    model_dtype: str
    tokenizer_hash: str  # tokenizer_hash(tokenizer)
    chunk_tokens: int
    overlap_tokens: int
    preamble_hash: str  # the schema text chunks are encoded after
    encoding_mode: str  # e.g. "isolated" or "scaffold"
    start_position: int  # canonical position of each chunk's first token
    embedder_name: str
    embedder_dim: int
    index_kind: str
    chunk_encoder: str = ""  # the splice adapter encoding side (its encoding_digest) chunk KV was made with; "": none


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk: its document, text, character span in that document, token count, user metadata and the
    hash of its token ids (``pc_rag.modules.keys.content_hash``; empty in stores of format 3 and older)."""

    doc_id: str
    text: str
    n_tokens: int
    start_char: int = 0
    end_char: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)
    content_hash: str = ""


@dataclass(frozen=True)
class DocRecord:
    """One source document: its chunk ids in order, a hash of its text, and user metadata."""

    chunk_ids: tuple[int, ...]
    sha256: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardRecord:
    """One safetensors file of chunk KV: checksum, size, the chunks it holds and which of them are deleted.

    ``codec`` is empty for raw KV, else ``cachegen:<table digest>`` with the quality ``levels`` each chunk has.
    ``chunk_sha256`` holds one checksum per chunk, in ``chunk_ids`` order (``_chunk_sums``), so damage to the
    file loses only the chunks it touches; empty in records written before format 5.
    """

    sha256: str
    nbytes: int
    chunk_ids: tuple[int, ...]
    dead: tuple[int, ...] = ()
    codec: str = ""
    levels: tuple[int, ...] = ()
    chunk_sha256: tuple[str, ...] = ()


@dataclass(frozen=True)
class IndexRecord:
    """The vector index file committed with this manifest, and its checksum."""

    name: str
    sha256: str


@dataclass
class Manifest:
    """Store contents. ``chunks`` by chunk id, ``docs`` by doc id, ``shards`` by file name relative to the store.

    ``generation`` counts commits; ``index`` is ``None`` for a new store and for format 1 (``index.faiss``).
    """

    identity: StoreIdentity | None = None
    chunks: dict[int, ChunkRecord] = field(default_factory=dict)
    docs: dict[str, DocRecord] = field(default_factory=dict)
    shards: dict[str, ShardRecord] = field(default_factory=dict)
    serving: dict[str, str] = field(default_factory=dict)  # what answers assume beyond the KV, e.g. "adapter"
    index: IndexRecord | None = None
    codec_tables: IndexRecord | None = None  # the CacheGen table file compressed shards decode with
    codec_levels: tuple[int, ...] = ()  # the levels new chunks are written at (none: raw KV)
    modules: str = ""  # the module store chunk KV lives in (its address when built); empty: this directory's shards
    generation: int = 0
    next_id: int = 0  # chunk ids below it were handed out once and are never reused
    format_version: int = FORMAT_VERSION

    def listed_files(self) -> set[str]:
        """Every file (relative to the store) this manifest commits: its shards, index and codec table files."""
        tables = {self.codec_tables.name} if self.codec_tables else set()
        return {*self.shards, self.index.name if self.index else LEGACY_INDEX_NAME, *tables}

    def next_chunk_id(self) -> int:
        """A chunk id never handed out by this store (not even to a chunk since deleted and compacted away)."""
        used = [max(self.chunks, default=-1)] + [max(s.chunk_ids, default=-1) for s in self.shards.values()]
        return max(max(used) + 1, self.next_id)

    def reserve_chunk_ids(self, n: int) -> range:
        """``n`` fresh chunk ids, never to be handed out again (once this manifest is saved)."""
        start = self.next_chunk_id()
        self.next_id = start + n
        return range(start, start + n)

    def to_json(self) -> str:
        """The manifest as JSON text; ``StoreError`` if some metadata is not JSON-serializable."""
        data = {
            "format_version": self.format_version,
            "identity": asdict(self.identity) if self.identity else None,
            "chunks": {str(i): asdict(c) for i, c in sorted(self.chunks.items())},
            "docs": {d: asdict(r) for d, r in self.docs.items()},
            "shards": {name: asdict(s) for name, s in sorted(self.shards.items())},
            "serving": dict(sorted(self.serving.items())),
            "index": asdict(self.index) if self.index else None,
            "codec_tables": asdict(self.codec_tables) if self.codec_tables else None,
            "codec_levels": list(self.codec_levels),
            "modules": self.modules,
            "generation": self.generation,
            "next_id": self.next_id,
        }
        try:
            return json.dumps(data, ensure_ascii=False, indent=1, allow_nan=False)
        except (TypeError, ValueError) as e:
            msg = f"store metadata must be JSON-serializable (str, int, float, bool, None, list, dict): {e}"
            raise StoreError(msg) from e

    def save(self, path: str | Path) -> None:
        """Write atomically to ``path`` (a store directory's ``manifest.json``), as the current format."""
        self.format_version = FORMAT_VERSION
        text = self.to_json().encode()
        atomic_write(Path(path), lambda f: f.write(text))

    @classmethod
    def load(cls, path: str | Path) -> Manifest:
        """Read and validate a manifest; ``StoreError`` if missing or of an unknown version, corrupted if malformed."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            msg = f"no store manifest at {path}"
            raise StoreError(msg) from e
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            msg = f"store manifest {path} is not valid JSON: {e}"
            raise StoreCorruptedError(msg) from e
        version = data.get("format_version") if isinstance(data, dict) else None
        if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= FORMAT_VERSION:
            msg = (
                f"store manifest {path} has format version {version!r}; this pc-rag reads versions 1..{FORMAT_VERSION}"
                " (upgrade pc-rag, or rebuild the store)"
            )
            raise StoreError(msg)
        try:
            identity, index, tables = data.get("identity"), data.get("index"), data.get("codec_tables")
            return cls(
                identity=StoreIdentity(**identity) if identity is not None else None,
                chunks={int(i): ChunkRecord(**c) for i, c in data["chunks"].items()},
                docs={d: DocRecord(**{**r, "chunk_ids": tuple(r["chunk_ids"])}) for d, r in data["docs"].items()},
                shards={check_shard_name(n): _shard(s) for n, s in data["shards"].items()},
                serving={str(k): str(v) for k, v in data.get("serving", {}).items()},
                index=IndexRecord(check_index_name(index["name"]), str(index["sha256"])) if index else None,
                codec_tables=IndexRecord(check_tables_name(tables["name"]), str(tables["sha256"])) if tables else None,
                codec_levels=tuple(int(n) for n in data.get("codec_levels", ())),
                modules=str(data.get("modules", "")),
                generation=int(data.get("generation", 0)),
                next_id=int(data.get("next_id", 0)),
                format_version=version,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            msg = f"store manifest {path} is malformed: {e!r}"
            raise StoreCorruptedError(msg) from e

    def check_compatible(self, expected: StoreIdentity | dict[str, Any]) -> None:
        """Raise ``StoreMismatchError`` naming every identity field that differs from ``expected``.

        ``expected`` may be partial (a dict of some fields); unknown field names are a ``ValueError``.
        """
        wanted = asdict(expected) if isinstance(expected, StoreIdentity) else dict(expected)
        known = {f.name for f in fields(StoreIdentity)}
        if unknown := sorted(set(wanted) - known):
            msg = f"unknown store identity fields {unknown}; known: {sorted(known)}"
            raise ValueError(msg)
        if self.identity is None:
            msg = "the store records no identity (model, tokenizer, chunking, embedder): it cannot be checked"
            raise StoreMismatchError(msg, {k: (None, v) for k, v in wanted.items()})
        stored = asdict(self.identity)
        diff = {k: (stored[k], v) for k, v in wanted.items() if stored[k] != v}
        if "model_name" in diff:  # another model: the fix is to load the store's, whatever else follows from it
            built, loaded = diff["model_name"]
            rest = sorted(set(diff) - _FOLLOW_THE_MODEL)
            also = f"; it also differs in {', '.join(rest)}" if rest else ""
            msg = (f"the store was built with the model {built!r}, not {loaded!r}: give `--model {shlex.quote(built)}` "
                   f"(in Python: load_model({built!r})){also}")  # fmt: skip
            raise StoreMismatchError(msg, diff)
        if diff:
            lines = "; ".join(f"{k}: store was built with {a!r}, you loaded {b!r}" for k, (a, b) in diff.items())
            msg = f"the store does not match this setup ({lines}); rebuild the store or load what it was built with"
            raise StoreMismatchError(msg, diff)


# identity fields another model changes by itself: named by the model mismatch, not one by one
_FOLLOW_THE_MODEL = {"model_name", "model_fingerprint", "model_dtype", "tokenizer_hash", "preamble_hash",
                     "start_position", "chunk_encoder"}  # fmt: skip


def _shard(data: dict[str, Any]) -> ShardRecord:
    return ShardRecord(
        sha256=data["sha256"],
        nbytes=int(data["nbytes"]),
        chunk_ids=tuple(int(i) for i in data["chunk_ids"]),
        dead=tuple(int(i) for i in data.get("dead", ())),
        codec=str(data.get("codec", "")),
        levels=tuple(int(n) for n in data.get("levels", ())),
        chunk_sha256=tuple(str(h) for h in data.get("chunk_sha256", ())),
    )


def tokenizer_hash(tokenizer: Any) -> str:
    """A short hash of a tokenizer's class, vocabulary, special tokens and chat template (duck-typed)."""
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    digest.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(repr(getattr(tokenizer, "all_special_tokens", [])).encode())
    digest.update(str(getattr(tokenizer, "chat_template", "") or "").encode())
    return digest.hexdigest()[:16]


def text_hash(text: str) -> str:
    """Short sha256 of a text (preambles, documents)."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
