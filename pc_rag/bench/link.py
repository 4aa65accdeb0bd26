"""``pc-rag bench link``: TTFT from a cold store over a bandwidth-limited link, bfloat16 modules against CacheGen.

For each sample question (closed context: its own passages as chunks, encoded for ``default``) and
each bandwidth, the chunks are fetched through ``Throttled`` (a real sleep for the bytes' time on the
link): as raw bfloat16 KV, at each CacheGen level, and by the ``AdaptiveLoader`` (which may also
choose to recompute a chunk from its text); then the question is answered from what was loaded.
Cold TTFT is loading plus the answer's own TTFT; warm is the answer alone from chunks already in
memory. Encoding the chunks and compressing them are not timed. This module knows nothing about
attention.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from math import inf

import numpy as np
import torch

from pc_rag.bench.timing import timed_runs
from pc_rag.codec import CacheGenCodec
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.kv import SpanKV
from pc_rag.rag.engine import Chunk, RagEngine
from pc_rag.store.loader import RAW, TEXT, AdaptiveLoader, Throttled

MODE = "default"


@dataclass
class LinkRow:
    bandwidth_bits_per_s: float
    storage: str  # "bfloat16", "cachegen:N", "cachegen:adaptive" or "warm" (chunks already in memory)
    ttft_ms: float  # median over the questions
    load_ms: float
    bytes_per_token: float
    levels: dict[str, int]  # what the adaptive loader chose, over all chunks


class _Blobs:
    """Chunks' bytes in memory as a ``ChunkSource``: CacheGen levels, and ``RAW`` for bfloat16 KV."""

    def __init__(self, blobs: dict[tuple[int, int], bytes]) -> None:
        self.blobs = blobs

    def levels(self, chunk_id: int) -> tuple[int, ...]:
        return tuple(n for (c, n) in self.blobs if c == chunk_id)

    def size(self, chunk_id: int, level: int) -> int:
        return len(self.blobs[chunk_id, level])

    def read(self, chunk_id: int, level: int) -> bytes:
        return bytes(self.blobs[chunk_id, level])


def link_benchmark(
    engine: RagEngine, codec: CacheGenCodec, bandwidths: Sequence[float], *, questions: int = 5,
    ttft_target_s: float = 1.0, max_new_tokens: int = 1,
) -> list[LinkRow]:  # fmt: skip
    """Rows per (bandwidth in bits/s, storage); see the module docstring."""
    levels = sorted(codec.tables.levels)
    cases = []
    for q in sample_questions()[:questions]:
        texts = [engine.passage_text(i + 1, title, text) for i, (title, text) in enumerate(q.passages)]
        chunks = engine.encode(texts, MODE)
        blobs = {(i, n): codec.encode(c.kv, n) for i, c in enumerate(chunks) for n in levels}
        blobs.update({(i, 0): _raw_bytes(c.kv) for i, c in enumerate(chunks)})
        cases.append((q.question, chunks, _Blobs(blobs)))
    decode_cost, recompute_cost = _costs(engine, codec, cases[0][1][0])
    rows = []
    for bandwidth in bandwidths:
        storages = ["bfloat16", *(f"cachegen:{n}" for n in levels), "cachegen:adaptive"]
        for storage in storages:
            ttfts, loads, nbytes, tokens, chosen = [], [], 0, 0, {}
            for question, chunks, source in cases:
                link = Throttled(source, bandwidth / 8)
                began = time.perf_counter()
                loaded, sizes, picks = _load(engine, codec, chunks, link, storage, ttft_target_s, decode_cost,
                                             recompute_cost, bandwidth / 8)  # fmt: skip
                load_s = time.perf_counter() - began
                result = engine.answer(loaded, question, MODE, max_new_tokens=max_new_tokens)
                ttfts.append(1000 * load_s + result.stats.ttft_ms)
                loads.append(1000 * load_s)
                nbytes += sizes
                tokens += sum(len(c.token_ids) for c in chunks)
                for pick in picks:
                    chosen[str(pick)] = chosen.get(str(pick), 0) + 1
            rows.append(LinkRow(bandwidth, storage, statistics.median(ttfts), statistics.median(loads),
                                nbytes / tokens, chosen))  # fmt: skip
    warm = [engine.answer(chunks, question, MODE, max_new_tokens=max_new_tokens).stats.ttft_ms
            for question, chunks, _ in cases]  # fmt: skip
    rows.append(LinkRow(0.0, "warm", statistics.median(warm), 0.0, 0.0, {}))
    return rows


def _load(
    engine: RagEngine, codec: CacheGenCodec, chunks: list[Chunk], link: Throttled, storage: str, target: float,
    decode_cost: float, recompute_cost: float, bytes_per_s: float,
) -> tuple[list[Chunk], int, list[int | str]]:  # fmt: skip
    """The chunks as loaded over ``link`` in ``storage``, the bytes fetched and the level of each (0: bfloat16).

    Every storage goes through the same pipelined loader (fetch one chunk while the previous ones decode); a
    fixed storage is a loader that has one level and never recomputes."""
    if storage == "cachegen:adaptive":
        source = link
    else:
        source, recompute_cost = _OneLevel(link, RAW if storage == "bfloat16" else int(storage.split(":")[1])), inf

    def decode(chunk_id: int, level: int, data: bytes) -> SpanKV:
        return _from_raw(data, chunks[chunk_id].kv) if level == RAW else codec.decode(data)

    loader = AdaptiveLoader(
        source, codec, ttft_target_s=target, decode_s_per_token=decode_cost, recompute_s_per_token=recompute_cost,
        initial_bytes_per_s=bytes_per_s, decode=decode,
    )  # fmt: skip
    results = loader.load([(i, len(c.token_ids)) for i, c in enumerate(chunks)])
    spans = [
        engine.encode_token_ids([list(c.token_ids)], c.conditioned)[0].kv if r.level == TEXT else r.span
        for c, r in zip(chunks, results, strict=True)
    ]
    loaded = [
        replace(c, kv=SpanKV(s.keys.to(c.kv.keys.dtype), s.values.to(c.kv.values.dtype), s.positions))
        for c, s in zip(chunks, spans, strict=True)
    ]
    return loaded, sum(r.nbytes for r in results), [r.level for r in results]


class _OneLevel:
    """A source seen at one level only."""

    def __init__(self, source: Throttled, level: int) -> None:
        self.source, self.level = source, level

    def levels(self, chunk_id: int) -> tuple[int, ...]:
        return (self.level,)

    def size(self, chunk_id: int, level: int) -> int:
        return self.source.size(chunk_id, level)

    def read(self, chunk_id: int, level: int) -> bytes:
        return self.source.read(chunk_id, level)


def _raw_bytes(kv: SpanKV) -> bytes:
    """Keys then values in bfloat16, as a raw store keeps them."""
    pair = torch.stack([kv.keys, kv.values]).to(torch.bfloat16).contiguous()
    return pair.view(torch.int16).numpy().tobytes()


def _from_raw(data: bytes, like: SpanKV) -> SpanKV:
    pair = torch.from_numpy(np.frombuffer(data, np.int16).copy()).view(torch.bfloat16)
    keys, values = pair.view(2, *like.keys.shape).to(like.keys.dtype)
    return SpanKV(keys, values, like.positions)


def _costs(engine: RagEngine, codec: CacheGenCodec, chunk: Chunk) -> tuple[float, float]:
    """Seconds per token to decode the best level and to recompute a chunk, measured on one chunk (the best of
    three, after a first call that compiles and warms up)."""
    blob = codec.encode(chunk.kv, max(codec.tables.levels))
    decode = min(timed_runs(lambda: codec.decode(blob), 3))
    recompute = min(timed_runs(lambda: engine.encode_token_ids([list(chunk.token_ids)], chunk.conditioned), 3))
    return decode / len(chunk.token_ids), recompute / len(chunk.token_ids)


def format_rows(rows: Sequence[LinkRow]) -> str:
    lines = [f"{'link':>9} {'storage':<18} {'TTFT ms':>9} {'load ms':>9} {'B/token':>8}  levels chosen"]
    for r in rows:
        link = "-" if not r.bandwidth_bits_per_s else f"{r.bandwidth_bits_per_s / 1e6:,.0f}M"
        chosen = ", ".join(f"{k}: {v}" for k, v in sorted(r.levels.items())) if r.storage.endswith("adaptive") else ""
        lines.append(
            f"{link:>9} {r.storage:<18} {r.ttft_ms:>9,.0f} {r.load_ms:>9,.0f} {r.bytes_per_token:>8,.0f}  {chosen}"
        )
    return "\n".join(lines)
