"""The module-store options of ``index``, ``ask`` and ``serve`` (light: parsers are built before anything loads)."""

from __future__ import annotations

import argparse


def add_module_args(parser: argparse.ArgumentParser, *, serving: bool = True) -> None:
    """``--modules`` (and, for commands that serve, ``--recompute-missing``) on ``parser``."""
    parser.add_argument(
        "--modules",
        default=None,
        metavar="ADDRESS",
        help="module store for chunk KV: redis://host:port/db or a directory (a new store keeps its "
        "KV there; an existing one is read there instead of at the address it was built with)",
    )
    if serving:
        parser.add_argument(
            "--recompute-missing",
            action="store_true",
            help="encode a chunk again from its text when its module is missing or unreachable",
        )


def module_options(args: argparse.Namespace) -> dict[str, object]:
    return {"modules": args.modules, "recompute_missing": args.recompute_missing}
