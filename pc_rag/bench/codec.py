"""``pc-rag bench codec``: CacheGen's size and speed per level, against zstd on the same quantized symbols.

Chunks are the sample questions' passages encoded for ``default``. Per level: bytes per token of the
whole compressed chunk (header, positions, exact tokens, rANS words, checksum); bytes per token of the
rANS words alone against zstd (level 19) of the same symbols, the baseline an entropy coder must beat;
encode and decode throughput in tokens/s, decoding one chunk after another and on ``workers`` threads
(what ``KVStore.get_many`` and the loader do). Times are the best of ``repeats`` after a warm-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import zstandard

from pc_rag.bench.timing import timed_runs
from pc_rag.codec import CacheGenCodec
from pc_rag.codec.quantize import quantize
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.rag.engine import RagEngine

MODE = "default"
ZSTD_LEVEL = 19


@dataclass
class CodecRow:
    codec: str  # "cachegen:LEVEL"
    chunks: int
    tokens: int
    bytes_per_token: float  # whole compressed chunks
    rans_bytes_per_token: float  # the entropy-coded symbols alone
    zstd_bytes_per_token: float  # zstd of the same symbols (int8, lane order), the baseline
    encode_tokens_per_s: float
    decode_tokens_per_s: float  # one chunk after another
    decode_tokens_per_s_parallel: float  # on ``workers`` threads
    workers: int


def codec_benchmark(
    engine: RagEngine, codec: CacheGenCodec, *, questions: int = 5, workers: int = 2, repeats: int = 3
) -> list[CodecRow]:
    """One row per level of ``codec``'s tables; see the module docstring."""
    texts = [
        engine.passage_text(i + 1, title, text)
        for q in sample_questions()[:questions]
        for i, (title, text) in enumerate(q.passages)
    ]
    spans = [c.kv for c in engine.encode(texts, MODE)]
    tokens = sum(s.keys.shape[2] for s in spans)
    rows = []
    for level in sorted(codec.tables.levels):
        blobs = [codec.encode(s, level) for s in spans]
        rans_bytes, zstd_bytes = _symbol_bytes(codec, spans, level)
        encode_s = min(timed_runs(lambda level=level: [codec.encode(s, level) for s in spans], repeats))
        serial_s = min(timed_runs(lambda blobs=blobs: [codec.decode(b) for b in blobs], repeats))
        with ThreadPoolExecutor(workers) as pool:
            parallel_s = min(timed_runs(lambda blobs=blobs: list(pool.map(codec.decode, blobs)), repeats))
        row = CodecRow(
            f"cachegen:{level}", len(spans), tokens, sum(map(len, blobs)) / tokens, rans_bytes / tokens,
            zstd_bytes / tokens, tokens / encode_s, tokens / serial_s, tokens / parallel_s, workers,
        )  # fmt: skip
        rows.append(row)
    return rows


def _symbol_bytes(codec: CacheGenCodec, spans: Sequence, level: int) -> tuple[int, int]:
    """Bytes of the rANS words and of zstd over the same quantized symbols, summed over ``spans``."""
    lv, coder = codec.tables.level(level), codec.tables.coder(level)
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    rans_bytes = zstd_bytes = 0
    for span in spans:
        q = quantize(torch.stack([span.keys, span.values]).float(), codec.tables.transform, lv.step, lv.limit)
        rans_bytes += coder.encode(q.symbols).nbytes
        lanes = q.symbols.transpose(3, 4).contiguous().numpy()  # each lane's symbols together, as rANS codes them
        zstd_bytes += len(compressor.compress(lanes.tobytes()))
    return rans_bytes, zstd_bytes


def format_rows(rows: Sequence[CodecRow]) -> str:
    lines = [
        f"{'codec':<11} {'B/token':>8} {'rANS B/t':>9} {'zstd B/t':>9} {'encode tok/s':>13} "
        f"{'decode tok/s':>13} {'decode tok/s (threads)':>23}"
    ]
    for r in rows:
        lines.append(
            f"{r.codec:<11} {r.bytes_per_token:>8,.0f} {r.rans_bytes_per_token:>9,.0f} {r.zstd_bytes_per_token:>9,.0f}"
            f" {r.encode_tokens_per_s:>13,.0f} {r.decode_tokens_per_s:>13,.0f}"
            f" {r.decode_tokens_per_s_parallel:>17,.0f} ({r.workers})"
        )
    return "\n".join(lines)
