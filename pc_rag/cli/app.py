"""The ``pc-rag`` command line: ``demo``, ``index``, ``ask``, ``serve``, ``store``, ``bench``, ``eval`` and ``tune``.

The CLI knows nothing about how serving works; it parses arguments, calls the
engine and prints.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from pc_rag.cli import bench_commands, module_args
from pc_rag.errors import PCRagError
from pc_rag.tune import cli as tune_cli

COMPUTE_DTYPE_NAMES = ("float32", "bfloat16", "int8", "int4")  # pc_rag.weights.COMPUTE_DTYPES, without torch
SERVING_COMMANDS = ("demo", "index", "ask", "serve")
MEASURED_DTYPES = {"smollm2-135m-instruct": "int4"}  # pc_rag.model.DEFAULT_MODEL, without torch
"""Per model, the serving default of ``default_dtype``: int4's full prefill keeps 96.8% of float32's first tokens
on the 554 dev questions and ``fast`` in it ΔF1 +0.42 [-0.90, +1.76] (docs/dtypes.md). Other models: float32."""


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line naming the problem (``pc-rag: error: …``, exit code 2), without the usage."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("pc-rag").strip()  # empty for the top-level parser
        where = f"{command}: " if command else ""
        self.exit(2, f"pc-rag: error: {where}{message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="pc-rag", description="Prompt Cache for retrieval-augmented QA.")
    parser.add_argument("--model", default=None, help="bundled model name, .gguf file or local HF directory")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default=None, choices=COMPUTE_DTYPE_NAMES,
                        help="compute dtype: float32, bfloat16, or int8 / int4 weights computing in bfloat16 "
                        "(default: the store's, else int4 for the bundled model on the CPU in demo, index, ask and "
                        "serve, else float32)")  # fmt: skip
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress, with weight-loading progress bars")
    parser.add_argument("--threads", default="auto", type=_threads,
                        help="torch threads: a count, or 'auto' (the default) for the cores other processes leave "
                        "free, chosen again at each request and every few decode steps")  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="build a store from sample passages and answer, cached vs full")
    demo.add_argument("--questions", type=int, default=4)
    idx = commands.add_parser("index", help="add text, markdown or JSONL files to a document store (resumable)")
    idx.add_argument("paths", nargs="+", help="files or directories (.txt, .md, .rst, .jsonl; see the README)")
    idx.add_argument("--store", type=Path, required=True, help="store directory (created if new or empty)")
    idx.add_argument("--chunk-tokens", type=_positive, default=None, help="tokens per chunk (new store; default 256)")
    idx.add_argument("--overlap", type=_non_negative, default=None,
                     help="tokens shared by consecutive chunks (new store; default 32)")  # fmt: skip
    idx.add_argument("--mode", default=None, help="recovery mode the store records (new store; default: fast, "
                     "or prefix for a model without a trained splice adapter)")  # fmt: skip
    idx.add_argument("--index-kind", default=None, choices=["flat", "hnsw", "ivf"], help="new store; default flat")
    idx.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                     help="KV storage (new store; default bfloat16, half of float32's size)")  # fmt: skip
    idx.add_argument("--codec", default=None, metavar="raw|cachegen[:LEVEL,...]",
                     help="compress the KV with CacheGen at these levels (new store; default raw)")  # fmt: skip
    idx.add_argument("--limit", type=_positive, default=None, help="index only the first N documents")
    idx.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                     help="encode on Ray actors (a cluster address, or none for one on this machine)")  # fmt: skip
    idx.add_argument("--actors", type=_positive, default=2, help="--ray: encoder actors, one CPU each (default 2)")
    module_args.add_module_args(idx, serving=False)
    ask = commands.add_parser("ask", help="answer a question from a document store")
    ask.add_argument("question")
    ask.add_argument("--store", type=Path, required=True, help="store directory")
    ask.add_argument("-k", "--k", type=_positive, default=5, help="chunks to retrieve (default 5)")
    ask.add_argument("--mode", default=None, help="recovery mode (default: the store's)")
    ask.add_argument("--full", action="store_true", help="also answer by full prefill and print its TTFT")
    ask.add_argument("--max-new-tokens", type=_positive, default=64, help="answer length limit (default 64)")
    module_args.add_module_args(ask)
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server over a document store")
    serve.add_argument("--store", type=Path, required=True, help="store directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=_positive, default=8000, help="port (default 8000)")
    serve.add_argument("--mode", default=None, help="recovery mode (default: the store's)")
    serve.add_argument(
        "--max-concurrency",
        "--max-batch",
        dest="max_batch",
        type=_positive,
        default=16,
        help="requests decoded together; more wait in the queue (default 16)",
    )
    serve.add_argument("--queue-limit", type=_positive, default=64, help="waiting requests before 429 (default 64)")
    serve.add_argument(
        "--prefix-cache-mb",
        type=_non_negative,
        default=512,
        help="memory for the KV of conversation prefixes, reused turn to turn (default 512; 0: off)",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("PC_RAG_API_KEY") or None,
        help="the bearer key every /v1 request must send (default: $PC_RAG_API_KEY; none: open)",
    )
    module_args.add_module_args(serve)
    store = commands.add_parser("store", help="verify (read-only), repair, compact, recode (compression) or "
                                "reencode (chunk KV from text, for a mode) a document store")  # fmt: skip
    store.add_argument("action", choices=["verify", "repair", "compact", "recode", "reencode"])
    store.add_argument("--store", type=Path, required=True, help="store directory")
    store.add_argument("--codec", default=None, metavar="raw|cachegen[:LEVEL,...]", help="recode: the new KV encoding")
    store.add_argument("--mode", default=None, help="reencode: the recovery mode to encode chunks for and record "
                       "(default: the store's)")  # fmt: skip
    store.add_argument("--json", type=Path, default=None, help="recode: write sizes and seconds as JSON here")
    bench_commands.add_parser(commands, _positive)
    _add_eval_parser(commands)
    tune_cli.add_parsers(commands, _positive)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return _run(args)
    except PCRagError as e:
        print(f"pc-rag: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    _loading_progress(args.verbose)
    if args.command == "eval":
        return _run_eval(args)
    if args.command == "bench" and args.kind == "gpu":  # builds its own random-weight model
        return bench_commands.run_bench_gpu(args)
    if args.command == "bench" and args.kind == "load":  # the server it loads runs in a subprocess
        return bench_commands.run_bench_load(args)
    if args.command == "bench" and args.kind == "conversation":  # so do its servers
        return bench_commands.run_bench_conversation(args)
    from pc_rag.model import DEFAULT_MODEL, load_model

    if args.command == "bench":
        bench_commands.check_args(args)  # refuse bad sizes before the model loads
    from pc_rag.cli import store_commands

    docs = None
    if getattr(args, "modules", None) is not None:
        from pc_rag.modules.open_store import check_module_address

        check_module_address(args.modules)
    if args.command == "index":  # read and check everything before the model loads or anything is written
        from pc_rag.store.codec_setup import parse_codec
        from pc_rag.store.files import MANIFEST_NAME
        from pc_rag.store.ingest import read_documents

        overlap, chunk = args.overlap, args.chunk_tokens
        if overlap is not None and overlap >= (chunk or store_commands.CREATION_DEFAULTS["chunk_tokens"]):
            msg = f"--overlap {overlap} must be smaller than --chunk-tokens {chunk or 256}"
            raise PCRagError(msg)
        store_commands.check_store_target(args.store, must_exist=False)
        parse_codec(args.codec)
        if args.ray is not None and args.modules is None and not (args.store / MANIFEST_NAME).is_file():
            raise PCRagError("--ray writes modules where every actor reaches them: give --modules (redis://, a dir)")
        docs = read_documents(args.paths)[: args.limit]
    elif args.command == "tune":
        tune_cli.check_tune_args(args)
        if args.install is not None:
            return tune_cli.run_install(args)
    elif args.command in ("ask", "store", "serve"):
        if args.command == "store" and (args.action == "recode") != (args.codec is not None):
            raise PCRagError("--codec goes with `store recode`, and `store recode` needs it")
        if args.command == "store" and args.action != "recode" and args.json is not None:
            raise PCRagError("--json goes with `store recode`")
        if args.command == "store" and args.action != "reencode" and args.mode is not None:
            raise PCRagError("--mode goes with `store reencode`")
        if args.command == "store" and args.mode is not None:
            from pc_rag.rag.modes import resolve_mode

            resolve_mode(args.mode)  # an unknown mode, before the model loads
        if args.command == "store" and args.codec is not None:
            from pc_rag.store.codec_setup import parse_codec

            parse_codec(args.codec)
        store_commands.check_store_target(args.store, must_exist=True)
        if args.command == "ask" and not args.question.strip():
            msg = "the question is empty"
            raise PCRagError(msg)
    _set_threads(args.threads)
    store = getattr(args, "store", None)
    dtype = args.dtype or (store_commands.store_compute_dtype(store) if store else None) or default_dtype(args)
    lm = load_model(args.model or DEFAULT_MODEL, device=args.device, dtype=dtype)
    if args.command == "tune":
        return tune_cli.run_tune(args, lm)
    if args.command == "tune-codec":
        return tune_cli.run_tune_codec(args, lm)
    if args.command == "tune-phrases":
        return tune_cli.run_tune_phrases(args, lm)
    if args.command == "demo":
        store_commands.demo(lm, args.questions)
    elif args.command == "index":
        assert docs is not None
        store_commands.index(lm, docs, args.store, chunk_tokens=args.chunk_tokens, overlap=args.overlap, mode=args.mode,
                             index_kind=args.index_kind, kv_dtype=args.kv_dtype, codec=args.codec,
                             modules=args.modules, ray=args.ray, actors=args.actors)  # fmt: skip
    elif args.command == "ask":
        store_commands.ask(lm, args.store, args.question, k=args.k, mode=args.mode, compare_full=args.full,
                           max_new_tokens=args.max_new_tokens, **module_args.module_options(args))  # fmt: skip
    elif args.command == "store":
        store_commands.store_maintenance(lm, args.action, args.store, args.codec, args.json, mode=args.mode)
    elif args.command == "serve":
        store_commands.serve(lm, args.store, host=args.host, port=args.port, mode=args.mode, max_batch=args.max_batch,
                             queue_limit=args.queue_limit, api_key=args.api_key,
                             prefix_cache_mb=args.prefix_cache_mb,
                             **module_args.module_options(args))  # fmt: skip
    elif args.command == "bench":
        bench_commands.run_bench(args, lm)
    return 0


def _loading_progress(verbose: bool) -> None:
    """Weight-loading progress bars (transformers' ``Loading weights``) only with ``--verbose``."""
    from transformers.utils import logging as transformers_logging

    if verbose:
        transformers_logging.enable_progress_bar()
    else:
        transformers_logging.disable_progress_bar()


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            msg = f"not an integer: {text!r}"
            raise argparse.ArgumentTypeError(msg) from None
        if value < minimum:
            msg = f"must be at least {minimum}, got {value}"
            raise argparse.ArgumentTypeError(msg)
        return value

    return parse


_positive, _non_negative = _at_least(1), _at_least(0)


def _limits(spec: str | None) -> int | list[int] | None:
    from pc_rag.errors import EvalError

    if spec is None:
        return None
    try:
        limits = [int(x) for x in spec.split(",")]
    except ValueError as e:
        msg = f"--limit takes N or N1,N2,... (one per --dataset), got {spec!r}"
        raise EvalError(msg) from e
    return limits[0] if len(limits) == 1 else limits


def _orders(spec: str | None, settings: list[str]) -> list[str]:
    """The chunk orders of open retrieval (none without it); ``EvalError`` for an unknown one or one without it."""
    from pc_rag.errors import EvalError
    from pc_rag.rag.order import DEFAULT_ORDER, ORDERS

    if "open" not in settings:
        if spec is not None:
            msg = f"--order lays out retrieved chunks: it needs --setting open, got --setting {','.join(settings)}"
            raise EvalError(msg)
        return []
    orders = list(dict.fromkeys(x.strip() for x in (spec or DEFAULT_ORDER).split(",") if x.strip()))
    if not orders or set(orders) - set(ORDERS):
        msg = f"--order takes {', '.join(ORDERS)} or several comma-separated; got {spec!r}"
        raise EvalError(msg)
    return orders


def _add_eval_parser(commands: argparse._SubParsersAction) -> None:
    ev = commands.add_parser("eval", help="F1, agreement with full prefill and TTFT per mode on multi-doc QA")
    ev.add_argument("--dataset", type=Path, action="append", required=True, help="JSONL file, ours or LongBench's")
    ev.add_argument("--modes", default="full,default", help="comma-separated: full and the engine's modes")
    ev.add_argument("--limit", default=None, help="first N evaluated examples of each dataset file, or N1,N2,... "
                    "per --dataset; counted after the tuning split is skipped")  # fmt: skip
    ev.add_argument("--include-tuning-split", action="store_true", help="also evaluate the examples reserved for "
                    "tuning adapters and calibration (pc_rag.eval.datasets.TUNING_SPLIT), skipped by default; "
                    "reproduces runs made before the split existed")  # fmt: skip
    ev.add_argument("--json", type=Path, default=None, help="write the result rows as JSON here")
    ev.add_argument("--plot", type=Path, default=None, help="write an F1-vs-TTFT PNG here")
    ev.add_argument("--max-new-tokens", type=int, default=32)
    ev.add_argument("--adapter", type=Path, default=None,
                    help="serve the adapter modes with this splice adapter file (pc-rag tune --out) instead of the "
                         "model's own")  # fmt: skip
    ev.add_argument("--setting", default="closed", help="closed, open or closed,open (open: pooled store, top-k)")
    ev.add_argument("-k", type=int, default=10, help="open retrieval: passages retrieved per question")
    ev.add_argument("--store-dir", type=Path, default=None, help="open retrieval: where pooled stores are "
                    "built and reused, one per pool and model (default: the pc-rag cache, eval-stores/)")  # fmt: skip
    ev.add_argument("--order", default=None, help="open retrieval: how the retrieved chunks are laid out, "
                    "best-first, best-last or lost-in-the-middle, or several comma-separated (each is its own "
                    "setting, open:<order>; default: pc_rag.rag.order.DEFAULT_ORDER)")  # fmt: skip
    ev.add_argument("--reference-dtype", default=None, choices=COMPUTE_DTYPE_NAMES,
                    help="answer `full` with the model in this dtype (the other modes use --dtype): a dtype's "
                    "quality guard, e.g. `--dtype int4 eval --reference-dtype float32 "
                    "--modes full,selective:1.0,default`")  # fmt: skip
    ev.add_argument("--state", type=Path, default=None, help="resume file (default: the --json path + .partial.jsonl)")
    ev.add_argument("--codec", default=None, metavar="cachegen[:LEVEL,...]",
                    help="also run each mode over its chunks compressed at these CacheGen levels (<mode>@cachegen:N "
                    "rows, with codec_kl and codec_agreement against the uncompressed mode)")  # fmt: skip
    ev.add_argument("--kv-dtype", default=None, metavar="DTYPE[,DTYPE...]",
                    help="also run each mode over its chunks with the KV stored in these dtypes (bfloat16, float16, "
                    "float32) and read back, as a store made with `pc-rag index --kv-dtype` serves them (<mode>@DTYPE "
                    "rows, compared with the mode on its chunks as encoded like --codec rows)")  # fmt: skip


def _run_eval(args: argparse.Namespace) -> int:
    """Validate everything cheap (modes, datasets, output paths) before the model is loaded."""
    from pc_rag.errors import EvalError
    from pc_rag.eval import aggregate, format_table, load_datasets, parse_modes, plot, run_eval, write_json
    from pc_rag.eval.contexts import ClosedContexts, ContextSource, OpenContexts
    from pc_rag.eval.report import require_matplotlib
    from pc_rag.model import DEFAULT_MODEL, cache_dir, load_model

    if args.max_new_tokens < 1:
        msg = f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"
        raise EvalError(msg)
    examples = load_datasets(args.dataset, _limits(args.limit), include_tuning_split=args.include_tuning_split)
    if not examples:
        skipped = "" if args.include_tuning_split else " outside the tuning split (--include-tuning-split)"
        msg = f"no examples{skipped} in {', '.join(map(str, args.dataset))}"
        raise EvalError(msg)
    from pc_rag.rag import MODES, RagEngine, RagPrompt
    from pc_rag.rag.modes import is_mode

    modes = parse_modes(args.modes, MODES, accepts=is_mode)
    codec_levels = _codec_levels(args.codec)
    if codec_levels:
        from pc_rag.eval.codec_modes import with_codec

        modes = with_codec(modes, codec_levels)
    kv_dtypes = [d.strip() for d in (args.kv_dtype or "").split(",") if d.strip()]
    if args.kv_dtype is not None:
        from pc_rag.eval.codec_modes import with_kv_dtypes

        modes = with_kv_dtypes(modes, kv_dtypes)
    settings = list(dict.fromkeys(x.strip() for x in args.setting.split(",") if x.strip()))
    if not settings or set(settings) - {"closed", "open"}:
        msg = f"--setting takes closed, open or closed,open; got {args.setting!r}"
        raise EvalError(msg)
    if args.k < 1:
        msg = f"-k must be >= 1, got {args.k}"
        raise EvalError(msg)
    orders = _orders(args.order, settings)
    state = args.state or (args.json.with_name(args.json.name + ".partial.jsonl") if args.json else None)
    for out in (args.json, args.plot, state):
        if out is not None and not out.parent.is_dir():
            msg = f"output directory does not exist: {out.parent}"
            raise EvalError(msg)
    if args.plot:
        require_matplotlib()

    if args.adapter is not None and not args.adapter.is_file():
        msg = f"--adapter {args.adapter}: no such file"
        raise EvalError(msg)
    lm = load_model(args.model or DEFAULT_MODEL, device=args.device, dtype=args.dtype or "float32")
    engine = RagEngine(lm, RagPrompt.longbench())
    if args.adapter is not None:
        from pc_rag.rag.tuned import merged_adapter

        # merged: served at the plain cost; an int8/int4 model also takes its float32 weights' adapter
        engine.tuned.use(merged_adapter(lm, args.adapter, lm.fitted_fingerprints()))
    reference = None
    if args.reference_dtype is not None:
        reference_lm = load_model(args.model or DEFAULT_MODEL, device=args.device, dtype=args.reference_dtype)
        reference = RagEngine(reference_lm, RagPrompt.longbench())
    stores = args.store_dir or cache_dir() / "eval-stores"
    records = []
    sources: list[ContextSource] = []
    for setting in settings:
        if setting == "closed":
            sources.append(ClosedContexts(engine))
        else:  # one pool of stores, laid out in each order
            pooled = OpenContexts(engine, examples, args.k, stores)
            sources += [pooled.in_order(order) for order in orders]
    codec = bench_commands.codec_for(lm) if codec_levels else None
    for contexts in sources:
        records += run_eval(
            engine, examples, modes, contexts, state_path=state, max_new_tokens=args.max_new_tokens,
            reference=reference, codec=codec,
        )  # fmt: skip
    rows = aggregate(records, modes)
    print(format_table(rows))
    if args.json:
        config = {
            "model": lm.name,
            "dtype": lm.compute_dtype,
            "full_dtype": args.reference_dtype or lm.compute_dtype,
            "datasets": [str(p) for p in args.dataset],
            "limit": args.limit,
            "include_tuning_split": args.include_tuning_split,
            "max_new_tokens": args.max_new_tokens,
            "modes": modes,
            "settings": settings,
            "k": args.k if "open" in settings else None,
            "orders": orders,
            "codec": args.codec,
            "codec_tables": codec.tables.digest if codec is not None else None,
            "kv_dtypes": kv_dtypes,
            "adapter": str(args.adapter) if args.adapter is not None else None,
            "adapter_digest": engine.tuned.adapter().digest if engine.tuned.has_adapter() else None,
        }
        write_json(rows, args.json, config)
    if args.plot:
        plot(rows, args.plot)
    return 0


def _codec_levels(spec: str | None) -> tuple[int, ...]:
    """The CacheGen levels of ``eval --codec``; ``EvalError`` for other specs or undefined levels."""
    from pc_rag.codec import level
    from pc_rag.errors import CodecError, EvalError, StoreError
    from pc_rag.store.codec_setup import parse_codec

    try:
        levels = parse_codec(spec)
        for number in levels:
            level(number)
    except (StoreError, CodecError) as e:
        raise EvalError(str(e)) from e
    return levels


def default_dtype(args: argparse.Namespace) -> str:
    """The compute dtype of a command given no ``--dtype`` and no store that names one. Serving commands on the
    CPU use the dtype measured for the model as the fastest whose full prefill keeps at least 95% first-token
    agreement with float32, ``fast`` within noise (``MEASURED_DTYPES``, docs/dtypes.md); measurement commands
    (bench, eval, tune) keep float32, the dtype their committed figures name."""
    if args.command in SERVING_COMMANDS and args.device == "cpu":
        from pc_rag.model import DEFAULT_MODEL

        return MEASURED_DTYPES.get(args.model or DEFAULT_MODEL, "float32")
    return "float32"


def _threads(value: str) -> str | int:
    """``--threads``: ``auto`` or a positive count."""
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"takes a positive count or 'auto', got {value!r}")
    return count


def _set_threads(threads: str | int | None) -> None:
    if threads == "auto":
        from pc_rag.runtime.threads import use_free_cores

        use_free_cores()
    elif threads is not None:
        import torch

        torch.set_num_threads(int(threads))
