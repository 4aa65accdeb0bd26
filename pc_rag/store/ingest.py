"""Read documents to index from text, markdown and JSONL files.

JSONL lines are either ``{"text": ..., "id"?: ..., "metadata"?: {...}, ...}``
(every other key, and every key of ``metadata``, becomes the document's
metadata; ``source`` defaults to ``file:line``) or a multi-doc QA example
``{"passages": [{"title", "text"}, ...]}`` whose passages each become a
document (deduplicated by content). Two rows with one ``id`` are read once when identical (the same text and
metadata, apart from the ``file:line`` source given by default) and refused otherwise, naming both lines.
Empty files are skipped with a warning; only when nothing else is left is that an error. This module knows
nothing about chunking, models or stores.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pc_rag.errors import StoreError

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")


@dataclass(frozen=True)
class SourceDocument:
    id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


def read_documents(paths: Iterable[str | Path]) -> list[SourceDocument]:
    """All documents in ``paths`` (files or directories of them), in order, without duplicates; ``StoreError``
    for two different documents with one id, or when every file is empty."""
    docs: dict[str, tuple[str, SourceDocument]] = {}  # id -> (where it was read, the document)
    empty = []
    for path in _files(paths):
        read = _read_jsonl(path) if path.suffix == ".jsonl" else _read_text(path)
        if not read:
            empty.append(path)
            logger.warning("skipping %s: it is empty", path)
        for where, doc in read:
            first = docs.setdefault(doc.id, (where, doc))
            if not _same(first[1], doc):
                msg = (f"{where}: id {doc.id!r} is also the id of {first[0]}, with another text or metadata: give "
                       "each document its own id (identical rows are read once)")  # fmt: skip
                raise StoreError(msg)
    if not docs:
        msg = f"{empty[0]} is empty" if len(empty) == 1 else f"all {len(empty)} files are empty" if empty else ""
        msg = f"no documents found in the given paths{': ' + msg if msg else ''}"
        raise StoreError(msg)
    return [doc for _, doc in docs.values()]


def _same(a: SourceDocument, b: SourceDocument) -> bool:
    """Whether two documents read under one id are the same, apart from the ``file:line`` source they get."""
    return a.text == b.text and _without_source(a) == _without_source(b)


def _without_source(doc: SourceDocument) -> dict[str, Any]:
    return {k: v for k, v in doc.metadata.items() if k != "source"}


def _files(paths: Iterable[str | Path]) -> list[Path]:
    out = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out += sorted(p for p in path.rglob("*") if p.suffix in (*TEXT_SUFFIXES, ".jsonl"))
        elif path.is_file():
            out.append(path)
        else:
            msg = f"no such file or directory: {path}"
            raise StoreError(msg)
    return out


def _decode(path: Path) -> str:
    data = path.read_bytes()
    if b"\x00" in data[:8192]:
        msg = f"{path} looks binary (NUL bytes); index text, markdown or JSONL files"
        raise StoreError(msg)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        msg = f"{path} is not UTF-8 text: {e}"
        raise StoreError(msg) from e


def _read_text(path: Path) -> list[tuple[str, SourceDocument]]:
    text = _decode(path)
    if not text.strip():
        return []
    return [(str(path), SourceDocument(id=str(path), text=text, metadata={"source": str(path)}))]


def _read_jsonl(path: Path) -> list[tuple[str, SourceDocument]]:
    docs = []
    for number, line in enumerate(_decode(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            msg = f"{path}:{number}: invalid JSON: {e}"
            raise StoreError(msg) from e
        if isinstance(row, dict) and isinstance(row.get("passages"), list):
            for p in row["passages"]:
                text = f"{p.get('title', '')}\n{p.get('text', '')}".strip()
                meta = {"title": p.get("title", ""), "source": f"{path}:{number}"}
                docs.append((f"{path}:{number}", SourceDocument(_content_id(text), text, meta)))
        elif isinstance(row, dict) and isinstance(row.get("text"), str) and row["text"].strip():
            nested = row.get("metadata") or {}
            if not isinstance(nested, dict):
                msg = f"{path}:{number}: 'metadata' must be an object, got {type(nested).__name__}"
                raise StoreError(msg)
            extra = {k: v for k, v in row.items() if k not in ("id", "text", "metadata")}
            meta = {"source": f"{path}:{number}", **extra, **nested}  # the user's own "source" wins
            doc = SourceDocument(str(row.get("id") or _content_id(row["text"])), row["text"], meta)
            docs.append((f"{path}:{number}", doc))
        else:
            msg = f"{path}:{number}: expected an object with a non-empty 'text' or a 'passages' list"
            raise StoreError(msg)
    return docs


def _content_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
