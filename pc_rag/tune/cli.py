"""The ``pc-rag tune``, ``tune-codec`` and ``tune-phrases`` subcommands: arguments and running (imports stay lazy)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from pc_rag.errors import PCRagError


def add_parsers(commands: argparse._SubParsersAction, positive: Callable[[str], int]) -> None:
    """The ``tune``, ``tune-codec`` and ``tune-phrases`` subcommands."""
    phrases = commands.add_parser(
        "tune-phrases", help="fit the model's stock phrases (speculative drafts) on its answers to the tuning split"
    )
    phrases.add_argument("--dataset", type=Path, required=True, help="the HotpotQA dev JSONL the tuning split is in")
    phrases.add_argument("--questions", type=positive, default=None, help="the first N of the split (default: all)")
    phrases.add_argument("--out", type=Path, default=None, help="table file (default: where serving looks for it)")
    fit = commands.add_parser("tune-codec", help="fit the model's CacheGen tables on passages of the tuning split")
    fit.add_argument("--dataset", type=Path, required=True, help="the HotpotQA dev JSONL the tuning split is in")
    fit.add_argument("--passages", type=positive, default=200, help="passages to fit on (default 200)")
    fit.add_argument("--out", type=Path, default=None, help="table file (default: where stores look for it)")
    tune = commands.add_parser(
        "tune", help="train the splice adapter by self-distillation, on the tuning split or on a store's own chunks"
    )
    data = tune.add_mutually_exclusive_group(required=True)
    data.add_argument("--dataset", type=Path, help="the HotpotQA dev JSONL the tuning split (300-699) is in")
    data.add_argument("--store", type=Path, help="a document store: the model writes questions about its chunks")
    data.add_argument(
        "--install", type=Path, metavar="FILE",
        help="serve this adapter (written by tune) if it beat the installed one on held-out pairs",
    )  # fmt: skip
    data.add_argument("--restore", action="store_true",
                      help="serve the shipped adapter again (removes the one --install put in the cache)")  # fmt: skip
    tune.add_argument("--work", type=Path, default=None,
                      help="teacher data and chunk stores (default: cache/tune, or cache/tune/store-<id>)")  # fmt: skip
    tune.add_argument("--out", type=Path, default=None,
                      help="new adapter file (default: cache/tune/adapters/<model>-<time>.safetensors); "
                      "serving uses it only after `tune --install`")  # fmt: skip
    tune.add_argument("--variants", default=None, help="comma-separated context variants (default: all)")
    tune.add_argument("--pairs", type=positive, default=400, help="--store: questions to write (default 400)")
    tune.add_argument("--held-out", type=float, default=0.1,
                      help="--store: share of documents kept for early stopping (default 0.1)")  # fmt: skip
    tune.add_argument("-k", "--k", type=positive, default=5, help="--store: chunks retrieved per question (default 5)")
    tune.add_argument("--teacher-only", action="store_true", help="only generate (or resume) the teacher data")
    tune.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    tune.add_argument("--alpha", type=float, default=16.0, help="LoRA alpha; scale = alpha / rank (default 16)")
    tune.add_argument("--targets", default="q_proj,o_proj", help="linear layers adapted (default q_proj,o_proj)")
    tune.add_argument(
        "--encoding", choices=["none", "shared", "separate"], default="none",
        help="the adapter's encoding side, trained jointly: none (query side only), shared (the same pairs act "
        "while chunks are encoded) or separate (pairs of its own); stores for `fast` are then encoded by it",
    )  # fmt: skip
    tune.add_argument("--init", type=Path, default=None,
                      help="start from this adapter file (same rank and targets), e.g. the shipped one")  # fmt: skip
    tune.add_argument("--questions", type=positive, default=None,
                      help="--dataset: train on the first N questions of the tuning split only")  # fmt: skip
    tune.add_argument("--epochs", type=int, default=4, help="passes over the training pairs (default 4)")
    tune.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    tune.add_argument("--accumulate", type=int, default=8, help="pairs per optimizer step (default 8)")
    tune.add_argument("--eval-every", type=int, default=400, help="pairs between validations (default 400)")
    tune.add_argument("--patience", type=int, default=3, help="validations without improvement to stop (default 3)")
    tune.add_argument(
        "--recompute", default="0", metavar="R1,R2,...",
        help="shares of chunk tokens the student recomputes first, as selective:<share> serves with "
        "+adapter-question; pairs cycle through them (default 0: the prefix path only)",
    )  # fmt: skip
    tune.add_argument(
        "--calibrate", default=None, metavar="T1,...:S1,...",
        help="then fit APE's temperature and scale on this grid, with the adapter (e.g. 0.9,1:1,1.1)",
    )  # fmt: skip


def _shares(text: str) -> tuple[float, ...]:
    try:
        shares = tuple(float(x) for x in text.split(","))
    except ValueError:
        shares = ()
    if not shares or any(not 0 <= x <= 1 for x in shares):
        msg = f"--recompute takes comma-separated shares between 0 and 1, got {text!r}"
        raise PCRagError(msg)
    return shares


def check_tune_args(args: argparse.Namespace) -> None:
    """Refuse what ``tune`` cannot run, before the model loads."""
    if args.init is not None and not args.init.is_file():
        msg = f"--init {args.init}: no such adapter file"
        raise PCRagError(msg)
    if args.out is not None:
        _check_out(args.out)
    if args.store is None:
        return
    if args.questions is not None:
        raise PCRagError("--questions goes with --dataset; --store writes --pairs questions")
    from pc_rag.cli.store_commands import check_store_target

    if args.variants is not None:
        raise PCRagError("--variants goes with --dataset; --store pairs are the store's own retrievals")
    if not 0 < args.held_out < 1:
        msg = f"--held-out is a share of documents between 0 and 1 (exclusive), got {args.held_out}"
        raise PCRagError(msg)
    check_store_target(args.store, must_exist=True)


def _check_out(out: Path) -> None:
    """Refuse an ``--out`` that would overwrite a file or write where serving looks (that is ``--install``)."""
    from pc_rag.rag.tuned import tuned_dirs

    if out.exists():
        msg = f"--out {out} exists; tune writes a new file: give another name"
        raise PCRagError(msg)
    if out.resolve().parent in {d.resolve() for d in tuned_dirs()}:
        msg = (f"--out {out} is where serving finds installed adapters; write elsewhere, then "
               "`pc-rag tune --install FILE` installs it if it beats the installed one")  # fmt: skip
        raise PCRagError(msg)


def _default_out(fingerprint: str) -> Path:
    """A new file for a trained adapter: ``cache/tune/adapters/<fingerprint>-<UTC time>.safetensors``."""
    import time

    from pc_rag.model import cache_dir

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = cache_dir() / "tune" / "adapters" / f"{fingerprint}-{stamp}.safetensors"
    n = 1
    while out.exists():
        out, n = out.with_name(f"{fingerprint}-{stamp}-{n}.safetensors"), n + 1
    return out


def run_install(args: argparse.Namespace) -> int:
    """``tune --install FILE`` (needs no model: the report names it)."""
    from pc_rag.tune.install import install

    done = install(args.install)
    was = ("no adapter" if done.replaced is None
           else f"{done.replaced}, held-out mean KL {done.replaced_kl:.4f}")  # fmt: skip
    print(f"installed {args.install} -> {done.path} (held-out mean KL {done.mean_kl:.4f}; it replaces {was})")
    print("undo with `pc-rag tune --restore` (the shipped adapter serves again)")
    return 0


def run_restore(lm: object) -> int:
    from pc_rag.tune.install import restore

    removed, now = restore(lm.fingerprint())  # type: ignore[attr-defined]
    gone = ", ".join(str(p) for p in removed) or "nothing (no adapter was installed)"
    print(f"removed {gone}; serving finds {now or 'no adapter for this model (none is shipped)'}")
    return 0


def run_tune(args: argparse.Namespace, lm: object) -> int:
    if args.restore:
        return run_restore(lm)
    if args.store is not None:
        return _run_tune_store(args, lm)
    from pc_rag.model import cache_dir
    from pc_rag.rag import RagEngine, RagPrompt
    from pc_rag.tune.command import tune
    from pc_rag.tune.pairs import VARIANTS

    engine = RagEngine(lm, RagPrompt.longbench())
    variants = tuple(v.strip() for v in args.variants.split(",")) if args.variants else VARIANTS
    adapter_config, train_config = _configs(args)
    out = args.out or _default_out(lm.fingerprint())
    grid = _calibration_grid(args.calibrate) if args.calibrate else None
    summary = tune(
        engine, args.dataset, args.work or cache_dir() / "tune", out, variants=variants,
        adapter_config=adapter_config, train_config=train_config, teacher_only=args.teacher_only,
        calibration_grid=grid, questions=args.questions, init=args.init,
    )  # fmt: skip
    if args.teacher_only:
        print(f"teacher data: {summary['teacher_pairs']} pairs")
        return 0
    _print_result(summary)
    return 0


def _configs(args: argparse.Namespace) -> tuple:
    """The ``AdapterConfig`` and ``TrainConfig`` the arguments ask for."""
    from pc_rag.rag.adapter import AdapterConfig
    from pc_rag.tune.train import TrainConfig

    targets = tuple(t.strip() for t in args.targets.split(","))
    adapter_config = AdapterConfig(args.rank, args.alpha, targets, encoding=args.encoding)
    train_config = TrainConfig(
        epochs=args.epochs, lr=args.lr, accumulate=args.accumulate, eval_every=args.eval_every, patience=args.patience,
        recompute=_shares(args.recompute),
    )  # fmt: skip
    return adapter_config, train_config


def _print_result(summary: dict) -> None:
    base, best, installed = summary["history"][0], summary["best"], summary["installed"]
    pairs = f"{summary['train_pairs']} training pairs, {summary['val_pairs']} validation"
    print(f"adapter -> {summary['adapter']} ({pairs}; not installed)")
    start = "without adapter" if summary.get("init") is None else "start"
    now = "" if installed is None else f", installed {installed['first_kl']:.4f} / {installed['mean_kl']:.4f}"
    print(f"validation KL(full || spliced), first token / 8 tokens: {start} {base['first_kl']:.4f} / "
          f"{base['mean_kl']:.4f}, new {best['first_kl']:.4f} / {best['mean_kl']:.4f}{now}")  # fmt: skip
    if installed is None or best["mean_kl"] < installed["mean_kl"]:
        print(f"serve it with `pc-rag tune --install {summary['adapter']}`")
    else:
        print("it is no better than the installed adapter on the held-out pairs; keep the installed one")
    if "calibration" in summary:
        c = summary["calibration"]
        print(f"APE calibration -> {c['path']}: temperature {c['temperature']}, scale {c['scale']}")


def _run_tune_store(args: argparse.Namespace, lm: object) -> int:
    import sys

    from pc_rag.cli.store_commands import engine_for
    from pc_rag.model import cache_dir
    from pc_rag.store.document_store import DocumentStore
    from pc_rag.tune.store_command import tune_store

    adapter_config, train_config = _configs(args)
    out = args.out or _default_out(lm.fingerprint())
    grid = _calibration_grid(args.calibrate) if args.calibrate else None
    with DocumentStore.load(args.store, engine_for(lm)) as store:
        work = args.work or cache_dir() / "tune" / f"store-{store.store_id}"
        summary = tune_store(
            store, work, out, pairs=args.pairs, k=args.k, held_out=args.held_out, adapter_config=adapter_config,
            train_config=train_config, teacher_only=args.teacher_only, calibration_grid=grid,
            progress=args.verbose or sys.stderr.isatty(), init=args.init,
        )  # fmt: skip
    kept, cost = summary["questions_kept"], summary["cost"]
    print(f"questions: {kept['train']} training, {kept['val']} held out ({summary['questions_written']} written; "
          f"the chunk asked about was retrieved for {summary['source_chunk_retrieved']:.0%}) in {work}")  # fmt: skip
    phases = ", ".join(f"{p} {cost[f'{p}_count']} in {cost[f'{p}_s'] / 60:.1f} min"
                       for p in ("questions", "teacher", "train") if f"{p}_s" in cost)  # fmt: skip
    if args.teacher_only:
        print(f"teacher data: {summary['teacher_pairs']} pairs ({phases})")
        return 0
    _print_result(summary)
    print(f"this run: {phases}")
    return 0


def run_tune_codec(args: argparse.Namespace, lm: object) -> int:
    from pc_rag.rag import RagEngine, RagPrompt
    from pc_rag.rag.tuned import codec_tables_file, tuned_dirs
    from pc_rag.tune.codec import fit_codec

    tables = fit_codec(RagEngine(lm, RagPrompt.longbench()), args.dataset, args.passages)
    out = args.out or tuned_dirs()[0] / codec_tables_file(lm.fingerprint())
    out.parent.mkdir(parents=True, exist_ok=True)
    tables.save(out)
    limits = ", ".join(f"{n}: step {lv.step}, range {lv.limit}" for n, lv in sorted(tables.levels.items()))
    print(f"CacheGen tables {tables.digest} -> {out} (levels {limits})")
    return 0


def run_tune_phrases(args: argparse.Namespace, lm: object) -> int:
    import sys

    from pc_rag.rag import RagEngine
    from pc_rag.rag.tuned import phrases_file, tuned_dirs
    from pc_rag.tune.phrases import fit_phrases

    phrases = fit_phrases(RagEngine(lm), args.dataset, args.questions, progress=args.verbose or sys.stderr.isatty())
    out = args.out or tuned_dirs()[0] / phrases_file(lm.fitted_fingerprints()[-1])  # type: ignore[attr-defined]
    out.parent.mkdir(parents=True, exist_ok=True)
    phrases.save(out)
    print(f"stock phrases -> {out}: {len(phrases)} contexts, from {phrases.source}")
    return 0


def _calibration_grid(spec: str) -> tuple[list[float], list[float]]:
    try:
        temperatures, scales = ([float(x) for x in part.split(",")] for part in spec.split(":"))
    except ValueError as e:
        msg = f"--calibrate takes T1,T2,...:S1,S2,..., got {spec!r}"
        raise PCRagError(msg) from e
    if not temperatures or not scales or min(temperatures + scales) <= 0:
        msg = f"--calibrate needs positive temperatures and scales, got {spec!r}"
        raise PCRagError(msg)
    return temperatures, scales
