"""Exception family of pc-rag.

Every error a user can cause (bad PML, unknown module, oversized argument,
unsupported model) is one of these, raised with enough context to fix it.
Internal invariants use ``assert`` instead.
"""

from __future__ import annotations


class PCRagError(Exception):
    """Base class of every error pc-rag raises on purpose."""


class PMLError(PCRagError):
    """A schema or prompt written in PML is invalid.

    Carries the offending ``name`` (module, param, schema) and the ``line`` and
    ``column`` in the XML source where known.
    """

    def __init__(
        self,
        message: str,
        *,
        name: str | None = None,
        line: int | None = None,
        column: int | None = None,
    ) -> None:
        self.message = message
        self.name = name
        self.line = line
        self.column = column
        where = f" (line {line}, column {column})" if line is not None else ""
        super().__init__(f"{message}{where}")


class PMLSyntaxError(PMLError):
    """The XML is malformed, too large, too deep, or uses forbidden features (DTD, entities)."""


class DuplicateNameError(PMLError):
    """Two modules, params or schemas share a name where names must be unique."""


class UnknownSchemaError(PMLError):
    """A prompt names a schema that has not been registered."""


class UnknownModuleError(PMLError):
    """A prompt imports a module that its schema does not declare."""


class UnknownParamError(PMLError):
    """A prompt passes an argument that the module does not declare."""


class UnionConflictError(PMLError):
    """A prompt imports two members of the same union."""


class ArgumentTooLongError(PMLError):
    """An argument needs more tokens than its ``<param len>`` reserves."""


class InvalidNameError(PMLError):
    """A module, param, scaffold or schema name is not an XML name, or is a reserved tag name."""


class PMLStructureError(PMLError):
    """Well-formed input that breaks PML's grammar: misplaced or unknown element, bad attribute."""


class UnsupportedModelError(PCRagError):
    """The model cannot be served by Prompt Cache (e.g. no RoPE, or RoPE that does not compose)."""


class ModelLoadError(PCRagError):
    """A model could not be found or loaded offline."""


class ContextLengthError(PCRagError):
    """A prompt's positions exceed the model's context window."""


class EvalError(PCRagError):
    """An evaluation input is invalid: missing or malformed dataset file, unknown mode, unusable state file."""


class ChunkingError(PCRagError):
    """A text cannot be split into chunks (e.g. it looks binary), or the tokenizer cannot report offsets."""


class EmbeddingError(PCRagError):
    """An embedding model returned something unusable: wrong shape, non-finite values, changing dimension."""


class StoreError(PCRagError):
    """A document store cannot be read or written: missing manifest, unsupported format version, bad input."""


class StoreCorruptedError(StoreError):
    """A store file is missing, truncated or does not match its recorded checksum; names the file."""


class StoreMismatchError(StoreError):
    """A store was built with a different model, tokenizer, chunking, embedder or index than requested.

    ``fields`` maps each differing field to ``(stored, expected)``.
    """

    def __init__(self, message: str, fields: dict[str, tuple[object, object]] | None = None) -> None:
        self.fields = dict(fields or {})
        super().__init__(message)


class StoreLockedError(StoreError):
    """Another process (or another open store object) is writing to the store; one writer at a time."""


class CodecError(PCRagError):
    """KV cannot be compressed or restored: unknown level, tables made for another model, damaged bytes."""


class CodecCorruptedError(CodecError, StoreCorruptedError):
    """Compressed KV bytes fail their checksum or do not parse; names the chunk when known."""


class KVPoolFullError(PCRagError):
    """The shared KV pool has no run of free chunks for a segment, even after dropping every idle one."""


class ServerBusyError(PCRagError):
    """Too many requests are waiting to be served; retry later (an HTTP server answers 429)."""


class ModuleStoreError(PCRagError):
    """A module store (a backend holding module KV, such as Redis) failed: unreachable, full or refusing."""


class ModuleStoreUnavailableError(ModuleStoreError):
    """The module store cannot be reached (stopped, restarting, network)."""


class ModuleStoreFullError(ModuleStoreError):
    """The module store refused a write for lack of memory; nothing else was changed."""


class ModuleCorruptedError(ModuleStoreError):
    """A stored module failed its checksum or is not a module frame: it is never used as KV."""
