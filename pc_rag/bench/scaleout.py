"""``pc-rag bench scaleout``: encoding throughput on Ray actors and TTFT from a shared Redis, each against its
baseline in the same run, on dev HotpotQA passages.

Encoding: the same passages are indexed by today's encoder (one process, 2 threads, local shards), by one
single-thread Ray actor and by two, into a Redis this benchmark starts (flushed before each run, so nothing is
resumed). Wall time includes the actors' start (model and embedder load), which is also timed alone.
TTFT: questions answered in the default mode from the local store and from the Redis one, hot (decoded spans
in the LRU) and cold (a store with no LRU: every module is read and decoded; the local shards' pages may
still be in the OS cache).
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import torch

from pc_rag.errors import PCRagError
from pc_rag.eval.datasets import load_examples
from pc_rag.model import LoadedModel, load_model
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.scaleout import EncoderSpec, RayChunkWorkers
from pc_rag.scaleout.local_redis import RedisServer
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.embeddings import SentenceTransformerEmbedder


@dataclass
class EncodeRun:
    path: str
    chunks: int
    tokens: int
    seconds: float
    tokens_per_s: float
    start_s: float | None = None  # one actor's model and embedder load, timed alone (Ray rows)
    steady_tokens_per_s: float | None = None  # tokens over the wall time less one actor start (Ray rows)


@dataclass
class TtftRun:
    store: str  # "local" or "redis"
    cache: str  # "hot" or "cold"
    questions: int
    ttft_ms_median: float
    ttft_ms: list[float]


def passages(dataset: Path, count: int) -> tuple[list[tuple[str, dict]], list[str]]:
    """The first ``count`` distinct passages of ``dataset``'s questions (tuning split excluded), and the
    questions whose passages are all among them."""
    docs: dict[str, dict] = {}
    questions = []
    for example in load_examples(dataset, skip_tuning_split=True):
        texts = [f"{p.title}\n{p.text}" for p in example.passages]
        if len(docs) + len(set(texts) - set(docs)) > count:
            if not questions:  # nothing to index or ask: every median would be of nothing
                msg = f"--passages {count} is fewer than the first question's {len(set(texts))} passages in {dataset}"
                raise PCRagError(msg)
            break
        docs.update({t: {"title": p.title} for t, p in zip(texts, example.passages, strict=True)})
        questions.append(example.question)
    if not questions:
        msg = f"{dataset} holds no question outside the tuning split to index and ask"
        raise PCRagError(msg)
    return list(docs.items()), questions


def run(lm: LoadedModel, dataset: Path, *, count: int, kv_dtype: torch.dtype, questions: int, workdir: Path) -> dict:
    """Both benchmarks; the result as one JSON-able dict."""
    docs, asked = passages(dataset, count)
    engine = RagEngine(lm, RagPrompt.longbench())
    (workdir / "redis").mkdir(parents=True, exist_ok=True)
    with RedisServer(workdir / "redis") as server:
        encode = [_index(engine, docs, workdir / "local", kv_dtype)]
        start = _actor_start(lm)
        for actors in (1, 2):
            redis.Redis.from_url(server.url).flushdb()
            encode.append(_index(engine, docs, workdir / f"ray{actors}", kv_dtype, server.url, actors, start))
        ttft = _ttft(engine, workdir / "local", workdir / "ray2", asked[:questions])
    rate = [r.tokens_per_s for r in encode]
    p50 = {(r.store, r.cache): r.ttft_ms_median for r in ttft}
    ratios = {"two_actors_vs_one": rate[2] / rate[1], "two_actors_vs_in_process": rate[2] / rate[0],
              "redis_vs_local_hot": p50["redis", "hot"] / p50["local", "hot"],
              "redis_vs_local_cold": p50["redis", "cold"] / p50["local", "cold"]}  # fmt: skip
    return {"passages": len(docs), "kv_dtype": str(kv_dtype).removeprefix("torch."), "ratios": ratios,
            "encode": [vars(r) for r in encode], "ttft": [vars(r) for r in ttft]}  # fmt: skip


def _index(
    engine: RagEngine, docs: list, directory: Path, kv_dtype: torch.dtype, url: str | None = None, actors: int = 0,
    start: float | None = None,
) -> EncodeRun:  # fmt: skip
    """Index ``docs`` into a new store: in this process on 2 threads (local shards), or with ``actors`` Ray actors
    into the Redis at ``url``; timed from the first chunk to the commit."""
    torch.set_num_threads(2)
    store = DocumentStore.create(directory, engine, embedder=SentenceTransformerEmbedder(), storage_dtype=kv_dtype,
                                 modules=url)  # fmt: skip
    with store:
        workers = RayChunkWorkers(EncoderSpec.of(store), actors=actors, batch_size=32) if actors else None
        began = time.perf_counter()
        store.add_documents(docs, progress=False, workers=workers)
        seconds = time.perf_counter() - began
        tokens = sum(r.n_tokens for r in store.manifest.chunks.values())
    if not actors:
        return EncodeRun("one process, 2 threads (local shards)", len(store), tokens, seconds, tokens / seconds)
    name = f"Ray, {actors} single-thread actor{'s' if actors > 1 else ''} (Redis)"
    return EncodeRun(name, len(store), tokens, seconds, tokens / seconds, start, tokens / (seconds - start))


def _actor_start(lm: LoadedModel) -> float:
    """Seconds one actor spends before its first batch: the model and the embedder loaded, single thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    began = time.perf_counter()
    RagEngine(load_model(lm.name, dtype=lm.compute_dtype), RagPrompt.longbench())
    SentenceTransformerEmbedder()
    torch.set_num_threads(threads)
    return time.perf_counter() - began


def _ttft(engine: RagEngine, local: Path, remote: Path, questions: list[str], k: int = 10) -> list[TtftRun]:
    """Default-mode TTFT per store and cache state, the four conditions interleaved per question."""
    torch.set_num_threads(2)
    embedder = SentenceTransformerEmbedder()
    paths, lru = {"local": local, "redis": remote}, {"hot": {}, "cold": {"lru_bytes": 0}}
    stores = {(name, cache): DocumentStore.load(path, engine, embedder=embedder, **lru[cache])
              for name, path in paths.items() for cache in lru}  # fmt: skip
    times: dict[tuple[str, str], list[float]] = {key: [] for key in stores}
    for question in questions:
        for key, store in stores.items():
            server = PromptServer(store=store)
            if key[1] == "hot":
                server.answer(question, k=k, max_new_tokens=1)  # the modules decoded into the LRU
            times[key].append(server.answer(question, k=k, max_new_tokens=1).result.stats.ttft_ms)
    for store in stores.values():
        store.close()
    return [TtftRun(name, cache, len(questions), statistics.median(ms), ms) for (name, cache), ms in times.items()]


def format_result(result: dict) -> str:
    lines = [f"{'encoding path':<44} {'chunks':>6} {'tokens':>7} {'s':>7} {'tok/s':>7} {'start s':>7} {'steady':>7}"]
    for r in result["encode"]:
        start = f"{r['start_s']:.1f}" if r["start_s"] is not None else "-"
        steady = f"{r['steady_tokens_per_s']:.0f}" if r["steady_tokens_per_s"] is not None else "-"
        lines.append(f"{r['path']:<44} {r['chunks']:>6} {r['tokens']:>7} {r['seconds']:>7.1f} "
                     f"{r['tokens_per_s']:>7.0f} {start:>7} {steady:>7}")  # fmt: skip
    lines.append(f"\n{'store':<6} {'cache':<5} {'questions':>9} {'TTFT p50 ms':>12}")
    lines += [
        f"{r['store']:<6} {r['cache']:<5} {r['questions']:>9} {r['ttft_ms_median']:>12.0f}" for r in result["ttft"]
    ]
    lines.append("\n" + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()))
    return "\n".join(lines)


def main(lm: LoadedModel, dataset: Path, *, count: int, questions: int, json_out: Path | None) -> None:
    if not dataset.is_file():
        raise PCRagError(f"--dataset {dataset} does not exist")
    with tempfile.TemporaryDirectory(prefix="pc-rag-scaleout-") as tmp:
        result = run(lm, dataset, count=count, kv_dtype=torch.bfloat16, questions=questions, workdir=Path(tmp))
    print(format_result(result))
    if json_out is not None:
        json_out.write_text(json.dumps(result, indent=2) + "\n")
