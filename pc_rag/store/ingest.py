"""Read documents to index from text, markdown and JSONL files.

JSONL lines are either ``{"text": ..., "id"?: ..., "metadata"?: {...}, ...}``
(every other key, and every key of ``metadata``, becomes the document's
metadata; ``source`` defaults to ``file:line``) or a multi-doc QA example
``{"passages": [{"title", "text"}, ...]}`` whose passages each become a
document (deduplicated by content). This module knows nothing
about chunking, models or stores.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pc_rag.errors import StoreError

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")


@dataclass(frozen=True)
class SourceDocument:
    id: str
    text: str
    metadata: dict[str, Any] = field(default_factory=dict)


def read_documents(paths: Iterable[str | Path]) -> list[SourceDocument]:
    """All documents in ``paths`` (files or directories of them), in order, without duplicates."""
    docs: dict[str, SourceDocument] = {}
    for path in _files(paths):
        for doc in _read_jsonl(path) if path.suffix == ".jsonl" else [_read_text(path)]:
            docs.setdefault(doc.id, doc)
    if not docs:
        msg = "no documents found in the given paths"
        raise StoreError(msg)
    return list(docs.values())


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


def _read_text(path: Path) -> SourceDocument:
    text = _decode(path)
    if not text.strip():
        msg = f"{path} is empty"
        raise StoreError(msg)
    return SourceDocument(id=str(path), text=text, metadata={"source": str(path)})


def _read_jsonl(path: Path) -> list[SourceDocument]:
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
                docs.append(SourceDocument(_content_id(text), text, meta))
        elif isinstance(row, dict) and isinstance(row.get("text"), str) and row["text"].strip():
            nested = row.get("metadata") or {}
            if not isinstance(nested, dict):
                msg = f"{path}:{number}: 'metadata' must be an object, got {type(nested).__name__}"
                raise StoreError(msg)
            extra = {k: v for k, v in row.items() if k not in ("id", "text", "metadata")}
            meta = {"source": f"{path}:{number}", **extra, **nested}  # the user's own "source" wins
            docs.append(SourceDocument(str(row.get("id") or _content_id(row["text"])), row["text"], meta))
        else:
            msg = f"{path}:{number}: expected an object with a non-empty 'text' or a 'passages' list"
            raise StoreError(msg)
    return docs


def _content_id(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
