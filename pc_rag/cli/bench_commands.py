"""``pc-rag bench``: its subcommands' arguments, their checks before the model loads, and running them.

Each benchmark lives in ``pc_rag.bench``; this module parses, checks and prints. Imports stay lazy.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pc_rag.bench.provenance import commit
from pc_rag.errors import PCRagError

if TYPE_CHECKING:  # the model and the codec load only when a benchmark runs
    from pc_rag.codec import CacheGenCodec
    from pc_rag.model import LoadedModel
    from pc_rag.rag import RagEngine


def add_parser(commands: argparse._SubParsersAction, positive: Callable[[str], int]) -> None:
    """The ``bench`` subcommand and its kinds."""
    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="kind", required=True)
    ttft = bench_kinds.add_parser("ttft", help="TTFT of cached vs full prefill by context length")
    ttft.add_argument("--tokens", default="1024,2048,4096,8000", help="comma-separated prompt lengths")
    ttft.add_argument("--runs", type=int, default=3, help="timed runs per length (median is reported)")
    ttft.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    ttft.add_argument("--plot", type=Path, default=None, help="write a TTFT-vs-context PNG here")
    peers = bench_kinds.add_parser("peers", help="TTFT and decode speed against other local serving paths")
    peers.add_argument("--tokens", default="1024,2048,4096,8000", help="comma-separated prompt lengths")
    peers.add_argument("--runs", type=int, default=3, help="timed runs per peer and length (median is reported)")
    peers.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    peers.add_argument(
        "--answers",
        action="store_true",
        help="time whole answers (up to 64 tokens, to EOS, the ask prompt, real sample questions, "
        "speculation on and off, llama.cpp's prompt lookup) instead of TTFT and a decode formula",
    )
    peers.add_argument("--questions", type=positive, default=5, help="with --answers: sample questions per length")
    peers.add_argument(
        "--busy",
        default="0,1,2",
        help="with --answers: counts of busy loops (0: idle) beside the default mode's first answer, each timed "
        "with a fixed thread count and with --threads auto",
    )
    encode = bench_kinds.add_parser("encode", help="store encoding throughput against the raw batched forward")
    encode.add_argument("--runs", type=positive, default=3, help="timed runs per path (median is reported)")
    encode.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    memory = bench_kinds.add_parser("memory", help="bytes per cached token for each storage dtype and codec level")
    memory.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    link = bench_kinds.add_parser("link", help="cold-store TTFT over a throttled link: bfloat16 vs CacheGen levels")
    link.add_argument("--bandwidth", default="100M,1G", help="comma-separated link speeds in bits/s (K, M, G)")
    link.add_argument("--questions", type=positive, default=5, help="sample questions (median is reported)")
    link.add_argument("--target-ms", type=positive, default=1000, help="the adaptive loader's TTFT target")
    link.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    codec = bench_kinds.add_parser("codec", help="CacheGen size and encode/decode speed per level, against zstd")
    codec.add_argument("--questions", type=positive, default=5, help="sample questions whose passages are coded")
    codec.add_argument("--workers", type=positive, default=2, help="decoding threads for the parallel column")
    codec.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    serve_bench = bench_kinds.add_parser("serve", help="many requests at once (continuous batching) vs one at a time")
    serve_bench.add_argument("--concurrency", type=positive, default=16, help="requests submitted together")
    serve_bench.add_argument("--shared-tokens", type=positive, default=1024, help="tokens every request imports")
    serve_bench.add_argument("--new-tokens", type=positive, default=32, help="tokens generated per request")
    serve_bench.add_argument("--json", type=Path, default=None, help="write the result as JSON here")
    serve_bench.add_argument(
        "--store", type=Path, default=None,
        help="instead: +rag answers from this store, --concurrency at once vs one at a time (pc_rag.bench.serve_rag)",
    )  # fmt: skip
    serve_bench.add_argument("--mode", default=None, help="with --store: recovery mode (default: the store's)")
    serve_bench.add_argument("--k", type=positive, default=3, help="with --store: chunks retrieved per question")
    gpu = bench_kinds.add_parser("gpu", help="every GPU acceptance gate on a random-weight model of a real shape")
    gpu.add_argument("--shape", default="llama-3b", help="llama-3b, llama-8b, qwen-7b, or tiny (a CPU check)")
    gpu.add_argument("--tokenizer", type=Path, default=None, help="tokenizer directory (default: the bundled one)")
    gpu.add_argument(
        "--only", default=None, help="comma-separated sections (fidelity,ttft,rag,decode,attention,serving)"
    )
    gpu.add_argument("--runs", type=positive, default=3, help="timed runs per figure (median is reported)")
    gpu.add_argument("--json", type=Path, default=None, help="write device, commit, shape and gates as JSON here")
    load = bench_kinds.add_parser(
        "load",
        help="the server under many streaming clients, some leaving: every "
        "request answered, refused with 429 or cleanly gone; no 5xx; RSS; no row left",
    )
    load.add_argument("--clients", type=positive, default=64, help="concurrent streaming clients (default 64)")
    load.add_argument("--leaving", type=int, default=16, help="clients that disconnect after 2 chunks (default 16)")
    load.add_argument("--max-concurrency", type=positive, default=4, help="the server's decoding slots (default 4)")
    load.add_argument("--queue-limit", type=positive, default=64, help="the server's queue before 429 (default 64)")
    load.add_argument("--max-tokens", type=positive, default=32, help="tokens asked per request (default 32)")
    load.add_argument("--documents", type=positive, default=40, help="sample passages indexed (default 40)")
    load.add_argument("--deadline", type=positive, default=900, help="seconds the clients may take (default 900)")
    load.add_argument("--log", type=Path, default=Path("bench-load-server.log"), help="the server's output")
    load.add_argument("--json", type=Path, default=None, help="write outcomes, RSS, machine and commit as JSON here")
    talk = bench_kinds.add_parser(
        "conversation", help="TTFT per turn of a +rag conversation over HTTP (openai client), history cache on and off"
    )
    talk.add_argument("--turns", type=positive, default=10, help="user turns (default 10)")
    talk.add_argument("--max-tokens", type=positive, default=16, help="tokens asked per turn (default 16)")
    talk.add_argument("--log", type=Path, default=Path("bench-conversation-server.log"), help="the servers' output")
    talk.add_argument("--json", type=Path, default=None, help="write the rows, machine and commit as JSON here")
    scale = bench_kinds.add_parser("scaleout", help="encoding on Ray actors and TTFT from Redis, against local")
    scale.add_argument("--dataset", type=Path, required=True, help="multi-doc QA JSONL whose passages are indexed")
    scale.add_argument("--passages", type=positive, default=600, help="distinct passages to index (default 600)")
    scale.add_argument("--questions", type=positive, default=10, help="questions timed per condition (default 10)")
    scale.add_argument("--json", type=Path, default=None, help="write the result as JSON here")


def check_args(args: argparse.Namespace) -> None:
    """Refuse malformed sizes before the model loads."""
    if args.kind in ("ttft", "peers"):
        _lengths(args.tokens)
    if args.kind == "link":
        _bandwidths(args.bandwidth)
    if args.kind == "serve" and args.store is not None:
        from pc_rag.cli.store_commands import check_store_target
        from pc_rag.rag.modes import resolve_mode

        check_store_target(args.store, must_exist=True)
        if args.mode is not None:
            resolve_mode(args.mode)


def run_bench_gpu(args: argparse.Namespace) -> int:
    """Exit 0, or 130 when a SIGINT (``timeout -s INT``) cut the run; the JSON is rewritten after every section."""
    from pc_rag.bench.gpu import default_tokenizer_dir, format_gates, run_gpu_bench

    # a shell starts background jobs with SIGINT ignored, and Python then installs no handler: the run would
    # ignore timeout's SIGINT and lose its current section to the kill that follows
    signal.signal(signal.SIGINT, signal.default_int_handler)
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only else None
    tokenizer = args.tokenizer or default_tokenizer_dir()
    path: Path | None = args.json

    def write(result: dict) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            partial.write_text(json.dumps(result, indent=1, default=str) + "\n")
            partial.replace(path)  # atomic: a kill between sections leaves the last whole JSON

    result = run_gpu_bench(args.shape, args.device, tokenizer, only=only, runs=args.runs, on_result=write)
    print(format_gates(result), flush=True)
    if result["interrupted"]:
        # the JSON is written; a thread the interrupted section left (the serving driver waits on a scheduler that
        # stopped) would hold the interpreter open until timeout's kill, costing the next shape its time
        sys.stderr.flush()
        os._exit(130)
    return 0


def run_bench_load(args: argparse.Namespace) -> int:
    """``bench load``: the server runs in a subprocess (this one loads no model). Exit 0 when every invariant held."""
    from dataclasses import asdict

    from pc_rag.bench.load import LoadPlan, drive, format_result, serve_sample
    from pc_rag.bench.provenance import machine

    if not 0 <= args.leaving <= args.clients:
        raise PCRagError(f"--leaving {args.leaving} must be between 0 and --clients {args.clients}")
    cli = server_cli(args)
    plan = LoadPlan(args.clients, args.leaving, args.max_tokens, float(args.deadline))
    sizes = {"max_concurrency": args.max_concurrency, "queue_limit": args.queue_limit, "documents": args.documents}
    with serve_sample(cli, log=args.log, **sizes) as (url, pid):
        result = drive(url, plan, pid)
    result.settings = {**sizes, "server_args": cli}
    print(format_result(result))
    if args.json:
        out = {"machine": machine(), "commit": commit(), "passed": result.passed, **asdict(result)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if result.passed else 1


def run_bench_conversation(args: argparse.Namespace) -> int:
    """``bench conversation``: the servers run in subprocesses (this one loads no model). Exit 0 when the cached
    turn 10 kept within 1.5x of turn 1 and every turn answered with sources."""
    from pc_rag.bench.conversation import format_conversation_run, run_http_conversation
    from pc_rag.bench.provenance import machine

    run = run_http_conversation(server_cli(args), turns=args.turns, new_tokens=args.max_tokens, log=args.log)
    print(format_conversation_run(run))
    if args.json:
        ratios = {"cache_ratio": run.ratio("cache"), "no_cache_ratio": run.ratio("no_cache")}
        out = {"machine": machine(), "commit": commit(), "server_args": server_cli(args), "passed": run.passed}
        out |= ratios | {"rows": run.rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if run.passed else 1


def server_cli(args: argparse.Namespace) -> list[str]:
    """The global options a server subprocess gets from this command's: device, model, dtype, threads."""
    named = (f"--{k}={v}" for k in ("model", "dtype", "threads") if (v := getattr(args, k)))
    return [f"--device={args.device}", *named]


def run_bench(args: argparse.Namespace, lm: LoadedModel) -> None:
    from pc_rag.bench.output import write_json
    from pc_rag.engine import PromptCache
    from pc_rag.rag import RagEngine, RagPrompt

    if args.kind == "ttft":
        from pc_rag.bench.ttft import plot_ttft, print_table, ttft_benchmark

        rows = ttft_benchmark(PromptCache(lm), _lengths(args.tokens), runs=args.runs)
        print_table(rows)
        if args.plot:
            plot_ttft(rows, args.plot)
    elif args.kind == "peers" and args.answers:
        from pc_rag.model import DEFAULT_MODEL, gguf_file

        gguf = gguf_file(args.model or DEFAULT_MODEL)
        _run_answers(args, RagEngine(lm), str(gguf) if gguf else None)
        return
    elif args.kind == "peers":
        from pc_rag.bench.peers import format_rows, run_peers
        from pc_rag.model import DEFAULT_MODEL, gguf_file, load_model

        gguf = gguf_file(args.model or DEFAULT_MODEL)
        engine = RagEngine(lm, RagPrompt.longbench())
        reference = None
        if lm.compute_dtype != "float32":  # what the compute dtype gains on full prefill, in the same run
            reference = RagEngine(load_model(lm.name, device=args.device), RagPrompt.longbench())
        rows = run_peers(engine, _lengths(args.tokens), args.runs, str(gguf) if gguf else None, reference=reference)
        print(format_rows(rows))
    elif args.kind == "link":
        from pc_rag.bench.link import format_rows, link_benchmark

        engine = RagEngine(lm, RagPrompt.longbench())
        rows = link_benchmark(engine, codec_for(lm), _bandwidths(args.bandwidth), questions=args.questions,
                              ttft_target_s=args.target_ms / 1000)  # fmt: skip
        print(format_rows(rows))
    elif args.kind == "codec":
        from pc_rag.bench.codec import codec_benchmark, format_rows

        engine = RagEngine(lm, RagPrompt.longbench())
        rows = codec_benchmark(engine, codec_for(lm), questions=args.questions, workers=args.workers)
        print(format_rows(rows))
    elif args.kind == "serve":
        from dataclasses import asdict

        from pc_rag.bench.serve import format_attention, format_serve, run_serve_bench

        if args.store is not None:
            from pc_rag.bench.provenance import machine
            from pc_rag.bench.serve_rag import format_rag_serve, run_rag_serve_bench
            from pc_rag.cli.store_commands import engine_for
            from pc_rag.store.document_store import DocumentStore

            store = DocumentStore.load(args.store, engine_for(lm))
            store.check_mode(args.mode)
            rag = run_rag_serve_bench(store, concurrency=args.concurrency, k=args.k, mode=args.mode,
                                      new_tokens=args.new_tokens)  # fmt: skip
            print(format_rag_serve(rag))
            if args.json:
                provenance = {"machine": machine(), "commit": commit()}
                args.json.write_text(json.dumps({**asdict(rag), **provenance}, indent=2) + "\n")
            return
        sizes = {"concurrency": args.concurrency, "shared_tokens": args.shared_tokens, "new_tokens": args.new_tokens}
        result, attention = run_serve_bench(PromptCache(lm), **sizes)
        print(format_serve(result))
        print(format_attention(attention))
        if args.json:
            out = {**asdict(result), "attention": [asdict(r) for r in attention]}
            args.json.write_text(json.dumps(out, indent=2) + "\n")
        return
    elif args.kind == "scaleout":
        from pc_rag.bench import scaleout

        return scaleout.main(lm, args.dataset, count=args.passages, questions=args.questions, json_out=args.json)
    elif args.kind == "encode":
        from pc_rag.bench.encode import encode_benchmark, format_rows

        rows = encode_benchmark(RagEngine(lm, RagPrompt.longbench()), runs=args.runs)
        print(format_rows(rows))
    else:
        import torch

        from pc_rag.bench.memory import format_rows, kv_footprint
        from pc_rag.codec import CodecTables
        from pc_rag.rag.tuned import find_tables

        tables = find_tables(lm)  # every level the model's CacheGen tables have
        levels = sorted(CodecTables.load(tables).levels) if tables else []
        engine = RagEngine(lm, RagPrompt.longbench())
        rows = kv_footprint(engine, [torch.float32, torch.bfloat16, torch.float16], levels=levels)
        print(format_rows(rows))
    if args.json:
        write_json(rows, args.json)


def _run_answers(args: argparse.Namespace, engine: RagEngine, gguf: str | None) -> None:
    """``bench peers --answers``: the rows as they are timed, then the summary and the gates; ``--json`` writes
    rows, summary, gates, machine and commit."""
    from dataclasses import asdict

    from pc_rag.bench.answer_time import gates, run_answers, summary
    from pc_rag.bench.provenance import machine

    busy = [int(b) for b in args.busy.split(",") if b.strip()]
    rows = run_answers(engine, _lengths(args.tokens), args.questions, args.runs, gguf, busy)
    table, checks = summary(rows), gates(rows, engine.default_mode)
    for line in table:
        print(json.dumps(line))
    for check in checks:
        print(f"{'met' if check['met'] else 'NOT MET':>7}  {check['name']}: {check['value']} {check['op']} "
              f"{check['threshold']}")  # fmt: skip
    if args.json:
        out = {"machine": machine(), "commit": commit(), "gates": checks, "summary": table,
               "rows": [asdict(r) for r in rows]}  # fmt: skip
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")


def codec_for(lm: LoadedModel) -> CacheGenCodec:
    from pc_rag.codec import CacheGenCodec, CodecTables
    from pc_rag.errors import EvalError
    from pc_rag.rag.tuned import find_tables

    path = find_tables(lm)
    if path is None:
        msg = f"no CacheGen tables for model {lm.fingerprint()}: make them with `pc-rag tune-codec`"
        raise EvalError(msg)
    return CacheGenCodec(CodecTables.load(path))


def _bandwidths(spec: str) -> list[float]:
    """Bits per second from ``100M,1G``-style text; ``PCRagError`` if malformed."""
    scale = {"K": 1e3, "M": 1e6, "G": 1e9}
    try:
        out = [float(x[:-1]) * scale[x[-1].upper()] if x[-1].upper() in scale else float(x) for x in spec.split(",")]
    except (ValueError, IndexError):
        out = []
    if not out or any(b <= 0 for b in out):
        raise PCRagError(f"--bandwidth takes comma-separated positive speeds like 100M,1G; got {spec!r}")
    return out


def _lengths(spec: str) -> list[int]:
    try:
        lengths = [int(t) for t in spec.split(",") if t.strip()]
    except ValueError as e:
        msg = f"--tokens takes comma-separated integers, got {spec!r}"
        raise PCRagError(msg) from e
    if not lengths or min(lengths) < 64:
        msg = f"--tokens needs lengths of at least 64 tokens, got {spec!r}"
        raise PCRagError(msg)
    return lengths
