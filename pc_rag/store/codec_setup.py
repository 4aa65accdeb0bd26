"""A store's KV codec: which CacheGen tables and levels it writes with, kept in the store directory.

``--codec`` specs are ``cachegen`` (the default level) or ``cachegen:N[,M...]`` (levels each chunk is
written at; serving uses the highest unless told otherwise). A store copies the model's tables (see
``pc_rag.rag.tuned``) into ``codec-<digest>.safetensors`` and lists them in the manifest with their
checksum, so it decodes without the package that made it. This module knows nothing about serving.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from pc_rag.codec import DEFAULT_LEVEL, CacheGenCodec, CodecTables
from pc_rag.errors import CodecError, StoreCorruptedError, StoreError
from pc_rag.rag.tuned import find_codec_tables, tuned_dirs
from pc_rag.store._atomic import fsync_dir, fsync_file, sha256_file, staged
from pc_rag.store.files import tables_name
from pc_rag.store.manifest import IndexRecord, Manifest


def parse_codec(spec: str | None) -> tuple[int, ...]:
    """The levels a ``--codec`` spec asks for (empty for none or ``raw``); ``StoreError`` if malformed."""
    if spec is None or spec == "raw":
        return ()
    name, _, levels = spec.partition(":")
    try:
        parsed = tuple(sorted({int(n) for n in levels.split(",")})) if levels else (DEFAULT_LEVEL,)
    except ValueError:
        parsed = ()
    if name != "cachegen" or not parsed:
        msg = f"--codec takes raw, cachegen or cachegen:LEVEL[,LEVEL...], got {spec!r}"
        raise StoreError(msg)
    return parsed


def model_tables(fingerprints: Sequence[str]) -> tuple[Path, CodecTables]:
    """Where the tables of a model are installed, and the tables: the first of ``fingerprints`` that has some
    (``LoadedModel.fitted_fingerprints``: its own, then an int8/int4 model's float32 weights); ``StoreError`` if
    none has."""
    wanted = tuple(fingerprints)
    source = next(filter(None, map(find_codec_tables, wanted)), None)
    if source is None:
        searched = ", ".join(str(d) for d in tuned_dirs())
        msg = f"no CacheGen tables for model {wanted[0]} in {searched}; make them with `pc-rag tune-codec`"
        raise StoreError(msg)
    tables = CodecTables.load(source)
    if tables.fingerprint not in wanted:
        msg = f"CacheGen tables {source} were fitted for model {tables.fingerprint}, not {wanted[0]}"
        raise StoreError(msg)
    return source, tables


def install_codec(
    directory: Path, manifest: Manifest, fingerprints: Sequence[str], levels: tuple[int, ...]
) -> CacheGenCodec:
    """Copy the model's tables into the store, record them and ``levels`` in ``manifest``; the codec."""
    source, tables = model_tables(fingerprints)
    for n in levels:
        tables.level(n)
    path = directory / tables_name(tables.digest)
    with staged(path) as tmp:
        shutil.copyfile(source, tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    fsync_dir(directory)
    manifest.codec_tables = IndexRecord(path.name, sha256_file(path))
    manifest.codec_levels = levels
    return CacheGenCodec(tables)


def open_codec(directory: Path, manifest: Manifest, fingerprint: str) -> CacheGenCodec | None:
    """The codec a store's manifest names (checked against its checksum and the model), or None."""
    record = manifest.codec_tables
    if record is None:
        return None
    path = directory / record.name
    if not path.is_file() or sha256_file(path) != record.sha256:
        msg = f"the store's CacheGen tables {path} are missing or do not match their checksum"
        raise StoreCorruptedError(msg)
    try:
        tables = CodecTables.load(path)
    except CodecError as e:
        raise StoreCorruptedError(str(e)) from e
    if tables.fingerprint != fingerprint:
        msg = f"the store's CacheGen tables were fitted for model {tables.fingerprint}, this model is {fingerprint}"
        raise StoreError(msg)
    return CacheGenCodec(tables)
