"""The ``pc-rag`` command line: ``demo`` and ``bench ttft``.

The CLI knows nothing about how serving works; it parses arguments, calls the
engine and prints.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pc_rag.errors import PCRagError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pc-rag", description="Prompt Cache for retrieval-augmented QA.")
    parser.add_argument("--model", default=None, help="bundled model name, .gguf file or local HF directory")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("-v", "--verbose", action="store_true")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="answer sample questions, cached vs full prefill")
    demo.add_argument("--questions", type=int, default=4)
    bench = commands.add_parser("bench", help="benchmarks")
    bench_kinds = bench.add_subparsers(dest="kind", required=True)
    ttft = bench_kinds.add_parser("ttft", help="TTFT of cached vs full prefill by context length")
    ttft.add_argument("--tokens", default="1024,2048,4096,8000", help="comma-separated prompt lengths")
    ttft.add_argument("--runs", type=int, default=3, help="timed runs per length (median is reported)")
    ttft.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return _run(args)
    except PCRagError as e:
        print(f"pc-rag: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from pc_rag.engine import PromptCache
    from pc_rag.model import DEFAULT_MODEL, load_model

    lm = load_model(args.model or DEFAULT_MODEL, device=args.device)
    pc = PromptCache(lm)
    if args.command == "demo":
        from pc_rag.demo import run_demo

        run_demo(pc, args.questions)
    elif args.command == "bench" and args.kind == "ttft":
        from pc_rag.bench import print_table, ttft_benchmark, write_json

        lengths = [int(t) for t in args.tokens.split(",") if t.strip()]
        rows = ttft_benchmark(pc, lengths, runs=args.runs)
        print_table(rows)
        if args.json:
            write_json(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
