"""``pc-rag bench peers``: our cached path against what a user would otherwise run, same model, same machine.

One RAG-shaped prompt per context length (LongBench preamble, passages from the
bundled sample, a question), served by every peer: TTFT is the median of
``runs`` timed first tokens after one warm-up, decode speed is measured on one
32-token reply, and ``end_to_end_ms`` is what a user waits for a 32-token answer:
TTFT plus 31 tokens at the measured decode speed (the same formula for every peer,
whether its reply stopped early at EOS or not). llama.cpp runs with as many threads
as torch. A peer that cannot run here (package missing, model file not found) is
reported with the reason instead of a number. This module knows nothing about how
serving works; it times engines and libraries.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from tqdm import tqdm

from pc_rag.errors import PCRagError
from pc_rag.hotpotqa_sample import sample_questions
from pc_rag.rag.engine import Chunk, RagEngine
from pc_rag.runtime.generate import GenerationResult

FULL_PREFILL = "full prefill (transformers, same runtime)"  # the row every speedup is measured against
FULL_PREFILL_FLOAT32 = "full prefill, float32 (transformers, same runtime)"
LLAMA_CPP = ("llama.cpp full prefill", "llama.cpp, prefix cache warm")
QUESTION = "Which of the passages above mentions a river, and what is its name?"
DECODE_TOKENS = 32


@dataclass
class PeerRow:
    peer: str
    context_tokens: int
    ttft_ms: float | None
    decode_tokens_per_s: float | None
    note: str = ""
    decode_tokens: int | None = None  # tokens of the decode-speed reply (fewer than 32 when it hit EOS)
    end_to_end_ms: float | None = None  # TTFT + 31 tokens at the decode speed: a 32-token answer
    dtype: str = ""  # our compute dtype (empty for peers with their own weights)
    threads: int = 0

    def __post_init__(self) -> None:
        if self.end_to_end_ms is None and self.ttft_ms is not None and self.decode_tokens_per_s:
            self.end_to_end_ms = self.ttft_ms + (DECODE_TOKENS - 1) / self.decode_tokens_per_s * 1000


@dataclass(frozen=True)
class Workload:
    """One prompt: the engine's chunks for the passages, the question, and the same prompt as plain text."""

    chunks: list[Chunk]
    question: str
    text: str  # the full chat-formatted prompt, for peers that take a string
    tokens: int
    documents_text: str  # the prompt up to the question: what a prefix cache can hold across questions


def build_workload(engine: RagEngine, target: int) -> Workload:
    """Passages from the bundled sample until the prompt holds about ``target`` tokens."""
    budget = passage_budget(engine, target)
    texts: list[str] = []
    passages = [p for q in sample_questions() for p in q.passages]
    for title, body in passages:
        ids = engine.tokenize(engine.passage_text(len(texts) + 1, title, body))[:budget]  # the last one is cut
        if len(ids) < 8:
            break
        texts.append(engine.lm.tokenizer.decode(ids))
        budget -= len(ids)
    chunks = engine.encode(texts, "default")
    ids = engine.full_ids(chunks, QUESTION)
    documents = len(engine.head_ids) + sum(len(c.token_ids) for c in chunks)
    decode = engine.lm.tokenizer.decode
    return Workload(chunks, QUESTION, decode(ids), len(ids), decode(ids[:documents]))


def passage_budget(engine: RagEngine, target: int) -> int:
    """Tokens left for passages in a prompt of ``target`` tokens; ``PCRagError`` if too few for one passage."""
    budget = target - len(engine.head_ids) - len(engine.tokenize(engine.prompt.tail(engine.wrappers, QUESTION)))
    if budget < 8:  # a negative budget would cut passages from their end instead of to nothing
        msg = f"--tokens {target} leaves no room for a passage: ask for at least {target - budget + 8} tokens"
        raise PCRagError(msg)
    return budget


class Reply(NamedTuple):
    """One timed reply: first-token ms (None when the peer cannot tell), whole-reply ms, tokens generated."""

    first_ms: float | None
    total_ms: float
    tokens: int


Timed = Callable[[int], Reply]  # max_new_tokens -> the reply


def measure(peer: str, tokens: int, timed: Timed, runs: int) -> PeerRow:
    """TTFT as the median of ``runs`` one-token replies after a warm-up; decode speed from a reply of up to
    32 tokens, over the tokens it actually generated (a reply may end early at EOS)."""
    timed(1)
    ttft = statistics.median(timed(1).total_ms for _ in range(runs))
    reply = timed(DECODE_TOKENS)
    decode_ms = reply.total_ms - (reply.first_ms if reply.first_ms is not None else ttft)
    speed = (reply.tokens - 1) / decode_ms * 1000 if reply.tokens > 1 and decode_ms > 0 else None
    note = "" if speed is not None else f"no decode speed: the reply ended after {reply.tokens} token(s)"
    return PeerRow(peer, tokens, ttft, speed, note, reply.tokens)


def engine_peers(engine: RagEngine, work: Workload, reference: RagEngine | None = None) -> dict[str, Timed | str]:
    """Our cached path (default recovery, fast and plain splicing), prefix caching and full prefill, one runtime;
    ``fast`` is the reason it cannot run when the model has no splice adapter. With ``reference`` (the same model
    in float32), its full prefill too: what the compute dtype gains."""

    def answer(mode: str) -> Timed:
        def run(n: int) -> Reply:
            # stats time the reply only: chunks are already encoded and stored, as in a store
            return _engine_reply(engine.answer(work.chunks, work.question, mode, max_new_tokens=n))

        return run

    def full(reuse_preamble: bool, on: RagEngine = engine) -> Timed:
        def run(n: int) -> Reply:
            full = on.answer_full(work.chunks, work.question, reuse_preamble=reuse_preamble, max_new_tokens=n)
            return _engine_reply(full)

        return run

    peers: dict[str, Timed | str] = {
        "pc-rag cached, default recovery": answer("default"),
        "pc-rag cached, fast (splice adapter, no recompute)": _with_adapter(engine, answer("fast")),
        "pc-rag cached, naive splice": answer("naive"),
        "prefix caching (preamble cached, documents computed)": full(True),
        FULL_PREFILL: full(False),
    }
    if reference is not None:
        peers[FULL_PREFILL_FLOAT32] = full(False, reference)
    return peers


def _with_adapter(engine: RagEngine, peer: Timed) -> Timed | str:
    try:
        engine.tuned.adapter()
    except PCRagError as e:
        return str(e)
    return peer


def _engine_reply(result: GenerationResult) -> Reply:
    return Reply(result.stats.ttft_ms, result.stats.total_ms, result.stats.new_tokens)


def huggingface_pipeline_peer(engine: RagEngine, work: Workload) -> Timed | str:
    """LangChain's ``HuggingFacePipeline`` over the same model object: the ordinary local-LLM path."""
    if importlib.util.find_spec("langchain_huggingface") is None:
        return "langchain-huggingface is not installed (pip install pc-rag[bench])"
    from langchain_huggingface import HuggingFacePipeline
    from transformers import pipeline

    lm = engine.lm
    pipe = pipeline("text-generation", model=lm.model, tokenizer=lm.tokenizer, device=lm.model.device)
    llm = HuggingFacePipeline(pipeline=pipe)

    def run(n: int) -> Reply:
        settings = {"max_new_tokens": n, "min_new_tokens": n, "do_sample": False, "return_full_text": False}
        start = time.perf_counter()
        llm.invoke(work.text, pipeline_kwargs=settings)
        return Reply(None, (time.perf_counter() - start) * 1000, n)  # min_new_tokens: exactly n

    return run


def llama_cpp_peers(gguf: str | None, work: Workload) -> dict[str, Timed | str]:
    """llama.cpp on the GGUF file: full prefill (KV cleared) and with its prefix cache warm."""
    if importlib.util.find_spec("llama_cpp") is None:
        reason = "llama-cpp-python is not installed (pip install llama-cpp-python; it compiles llama.cpp)"
        return dict.fromkeys(LLAMA_CPP, reason)
    if gguf is None:
        return dict.fromkeys(LLAMA_CPP, "the model was not loaded from a GGUF file")
    from llama_cpp import Llama

    threads = torch.get_num_threads()  # llama-cpp-python's default is half the cores
    llm = Llama(
        model_path=gguf, n_ctx=max(2048, work.tokens + DECODE_TOKENS + 64), n_threads=threads,
        n_threads_batch=threads, verbose=False,
    )  # fmt: skip
    prompt = llm.tokenize(work.text.encode(), add_bos=False, special=True)
    documents = llm.tokenize(work.documents_text.encode(), add_bos=False, special=True)

    def cold(n: int) -> Reply:
        llm.reset()  # forget every cached token: a full prefill
        return _llama_ms(llm, prompt, n)

    def warm(n: int) -> Reply:
        # an earlier request held the same preamble and documents (another question); generate() reuses the
        # longest common prefix of its context, so only the question is computed, as in our cached path
        llm.reset()
        _llama_ms(llm, documents, 1)
        return _llama_ms(llm, prompt, n)

    return dict(zip(LLAMA_CPP, (cold, warm), strict=True))


def _llama_ms(llm: object, prompt: list[int], n: int) -> Reply:
    start = time.perf_counter()
    first, count = None, 0
    for count, _ in enumerate(llm.generate(prompt, temp=0.0), start=1):  # type: ignore[attr-defined]
        if first is None:
            first = (time.perf_counter() - start) * 1000
        if count == n:
            break
    return Reply(first, (time.perf_counter() - start) * 1000, count)


def kvboost_peer(engine: RagEngine, work: Workload) -> Timed | str:
    """KVBoost's chunk-level KV reuse over the same transformers model, warmed with the same prompt."""
    if importlib.util.find_spec("kvboost") is None:
        return "kvboost is not installed (pip install pc-rag[bench])"
    from kvboost import KVBoost

    boost = KVBoost(model=engine.lm.model, tokenizer=engine.lm.tokenizer, max_cache_bytes=4 << 30, device="cpu")
    boost.generate(work.text, max_new_tokens=1)  # stores the prompt's chunks

    def run(n: int) -> Reply:
        start = time.perf_counter()
        result = boost.generate(work.text, max_new_tokens=n)
        return Reply(result.ttft_ms, (time.perf_counter() - start) * 1000, result.generated_tokens)

    return run


def run_peers(
    engine: RagEngine,
    lengths: Sequence[int],
    runs: int,
    gguf: str | None,
    progress: bool = True,
    reference: RagEngine | None = None,
) -> list[PeerRow]:
    """Every peer at every length; unavailable peers get one row each with the reason.

    ``progress`` shows a bar over (length, peer) naming the peer being timed (an 8K run takes minutes per peer).
    ``reference``: the same model in float32, whose full prefill is timed too.
    """
    for target in lengths:  # refuse a length too short before timing anything
        passage_budget(engine, target)
    rows: list[PeerRow] = []
    dtypes = {FULL_PREFILL_FLOAT32: "float32", **dict.fromkeys(LLAMA_CPP, "gguf")}
    with tqdm(desc="peers", unit="peer", disable=not progress) as bar:
        for target in lengths:
            work = build_workload(engine, target)
            peers = engine_peers(engine, work, reference)
            peers["LangChain HuggingFacePipeline"] = huggingface_pipeline_peer(engine, work)
            peers.update(llama_cpp_peers(gguf, work))
            peers["KVBoost (chunk KV reuse, warm)"] = kvboost_peer(engine, work)
            bar.total = len(lengths) * len(peers)
            for name, peer in peers.items():
                bar.set_postfix_str(f"{name} @{work.tokens}")
                row = _timed_row(name, work.tokens, peer, runs)
                row.threads = torch.get_num_threads()
                row.dtype = dtypes.get(name, engine.lm.compute_dtype)  # the others run our model object
                rows.append(row)
                bar.update()
    return rows


def _timed_row(name: str, tokens: int, peer: Timed | str, runs: int) -> PeerRow:
    if isinstance(peer, str):
        return PeerRow(name, tokens, None, None, peer)
    try:
        return measure(name, tokens, peer, runs)
    except Exception as e:  # noqa: BLE001 - a peer failing is a result to report, not a crash
        return PeerRow(name, tokens, None, None, f"failed: {type(e).__name__}: {e}"[:200])


def format_rows(rows: Sequence[PeerRow]) -> str:
    """A plain-text table: TTFT, speedup against full prefill at the same length, decode tokens/s over how many
    generated tokens."""
    full = {r.context_tokens: r.ttft_ms for r in rows if r.peer == FULL_PREFILL and r.ttft_ms}
    head = f"{'peer':<54} {'tokens':>6} {'TTFT ms':>9} {'vs full':>8} {'decode tok/s':>12} {'over':>5} {'32-tok ms':>9}"
    lines = [head]
    for r in rows:
        if r.ttft_ms is None:
            lines.append(f"{r.peer:<54} {r.context_tokens:>6} {'-':>9} {'-':>8} {'-':>12}  {r.note}")
            continue
        ratio = full.get(r.context_tokens, 0) / r.ttft_ms
        decode = f"{r.decode_tokens_per_s:.1f}" if r.decode_tokens_per_s else "-"
        over = str(r.decode_tokens) if r.decode_tokens is not None else "-"
        e2e = f"{r.end_to_end_ms:.0f}" if r.end_to_end_ms is not None else "-"
        line = f"{r.peer:<54} {r.context_tokens:>6} {r.ttft_ms:>9.1f} {ratio:>7.1f}x {decode:>12} {over:>5} {e2e:>9}"
        lines.append(f"{line}  {r.note}".rstrip())
    return "\n".join(lines)
