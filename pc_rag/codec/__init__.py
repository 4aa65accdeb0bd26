"""CacheGen (Liu et al., SIGCOMM 2024) for stored modules: KV to compact bytes at a chosen quality level.

``fit_tables`` learns one model's transform and probability tables from sample modules;
``CacheGenCodec`` turns a ``SpanKV`` into self-describing bytes and back.
"""

from pc_rag.codec.cachegen import CacheGenCodec
from pc_rag.codec.levels import DEFAULT_LEVEL, LEVELS, Level, level
from pc_rag.codec.tables import CodecTables, fit_tables

__all__ = ["DEFAULT_LEVEL", "LEVELS", "CacheGenCodec", "CodecTables", "Level", "fit_tables", "level"]
