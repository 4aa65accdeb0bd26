"""``pc-rag index``, ``ask``, ``store`` and ``demo``: the document-store jobs behind the CLI.

These functions validate input before anything is written, print results for a
person, and leave every decision about serving to the store and the engine.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from pc_rag.errors import PCRagError, StoreError
from pc_rag.model import LoadedModel
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.codec_setup import parse_codec
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.files import bytes_on_disk, check_store_directory
from pc_rag.store.handles import ModuleHandle
from pc_rag.store.ingest import SourceDocument
from pc_rag.store.kvstore import STORAGE_DTYPES
from pc_rag.store.manifest import MANIFEST_NAME, Manifest

CREATION_DEFAULTS = {
    "chunk_tokens": 256, "overlap": 32, "mode": None, "index_kind": "flat", "kv_dtype": "bfloat16",
    "codec": None,
}  # fmt: skip
COMMIT_EVERY_CHUNKS = 512  # a killed `index` loses at most this much work, or
COMMIT_EVERY_SECONDS = 30.0  # this much time's


def engine_for(lm: LoadedModel) -> RagEngine:
    """The engine every CLI store uses: LongBench's multi-document QA prompt."""
    return RagEngine(lm, RagPrompt.longbench())


def check_store_target(store_dir: Path, *, must_exist: bool) -> None:
    """Refuse a store path that cannot be one, before the model loads or anything is written."""
    try:
        is_store = check_store_directory(store_dir, for_new_store=not must_exist)
    except StoreError as e:
        raise StoreError(f"--store {e}") from None
    if must_exist and not is_store:
        msg = f"--store {store_dir} is not a pc-rag store (no {MANIFEST_NAME}); build one with `pc-rag index`"
        raise StoreError(msg)


def store_compute_dtype(store_dir: Path) -> str | None:
    """The compute dtype a store's KV was made in (``None`` when there is no store there yet)."""
    if not (store_dir / MANIFEST_NAME).is_file():
        return None
    identity = Manifest.load(store_dir / MANIFEST_NAME).identity  # a damaged manifest is named here
    return identity.model_dtype.split("/")[0] if identity is not None else None


def index(
    lm: LoadedModel, docs: list[SourceDocument], store_dir: Path, *, modules: str | None = None,
    ray: str | None = None, actors: int = 2, **options: object,
) -> None:  # fmt: skip
    """Add ``docs`` to the store at ``store_dir`` (created with ``options``, or loaded: options must not differ).

    Unchanged documents are skipped, and a commit follows every ``COMMIT_EVERY_CHUNKS`` chunks or
    ``COMMIT_EVERY_SECONDS``, whichever comes first: rerunning a killed ``index`` resumes it (and chunks whose
    module a module store already holds are not encoded again).
    With ``ray``, ``actors`` Ray actors encode into the module store (``modules``, which ``ray`` needs).
    """
    engine = engine_for(lm)
    if (store_dir / MANIFEST_NAME).exists():
        store = DocumentStore.load(store_dir, engine, modules=modules)
        _note_ignored_options(store, options)
    else:
        given = {**CREATION_DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
        store = DocumentStore.create(
            store_dir, engine, chunk_tokens=given["chunk_tokens"], overlap_tokens=given["overlap"],
            mode=given["mode"], index_kind=given["index_kind"], storage_dtype=STORAGE_DTYPES.get(given["kv_dtype"]),
            codec=given["codec"], modules=modules,
        )  # fmt: skip
    workers = None
    if ray is not None:
        from pc_rag.scaleout import EncoderSpec, RayChunkWorkers

        address = None if ray == "local" else ray
        workers = RayChunkWorkers(EncoderSpec.of(store, modules), actors=actors, address=address,
                                  embedder=store.embedder)  # fmt: skip
    with store:
        unchanged = sum(store.is_current(d.id, d.text, d.metadata) for d in docs)
        changed = sum(d.id in store.manifest.docs for d in docs) - unchanged
        start, before = time.perf_counter(), store.manifest.next_chunk_id()
        store.add_documents(
            [(d.text, d.metadata) for d in docs],
            ids=[d.id for d in docs],
            commit_every=COMMIT_EVERY_CHUNKS,
            commit_seconds=COMMIT_EVERY_SECONDS,
            workers=workers,
        )
        seconds = time.perf_counter() - start
        encoded = [c for d in docs for c in store.manifest.docs[d.id].chunk_ids if c >= before]
        tokens = sum(store.manifest.chunks[c].n_tokens for c in encoded)
        print(f"indexed {len(docs)} documents ({len(docs) - changed - unchanged} new, {changed} changed, "
              f"{unchanged} unchanged and skipped): {len(encoded)} chunks, {tokens} tokens encoded in "
              f"{seconds:.1f} s")  # fmt: skip
        print(f"store: {len(store.manifest.docs):,} documents, {len(store):,} chunks, "
              f"{bytes_on_disk(store_dir) / 2**20:,.1f} MiB on disk")  # fmt: skip


def _note_ignored_options(store: DocumentStore, options: dict[str, object]) -> None:
    """Tell the user which creation-only options an existing store ignores."""
    identity = store.manifest.identity
    assert identity is not None
    levels = store.manifest.codec_levels
    built = {
        "chunk_tokens": identity.chunk_tokens, "overlap": identity.overlap_tokens, "mode": store.mode,
        "index_kind": identity.index_kind, "kv_dtype": identity.model_dtype.split("/")[-1],
        "codec": "cachegen:" + ",".join(map(str, levels)) if levels else "raw",
    }  # fmt: skip
    for name, value in options.items():
        if name == "codec" and value is not None:
            value = "cachegen:" + ",".join(map(str, parse_codec(value))) if parse_codec(value) else "raw"
        if value is not None and value != built[name]:
            flag = "--" + name.replace("_", "-")
            print(f"pc-rag: note: {flag} {value} ignored: the store was created with {built[name]} and keeps it "
                  "(these options only apply when a store is created)", file=sys.stderr)  # fmt: skip


def store_maintenance(
    lm: LoadedModel, action: str, store_dir: Path, codec: str | None = None, json_out: Path | None = None, *,
    mode: str | None = None,
) -> None:  # fmt: skip
    """``verify`` (read-only: every checksum and cross-reference), ``repair``, ``compact``, ``recode`` (as
    ``codec``; ``json_out`` records sizes, tokens and seconds) or ``reencode`` (every chunk's KV from its text, for
    ``mode``, default the store's) the store."""
    with DocumentStore.load(store_dir, engine_for(lm)) as store:
        if action == "reencode":
            print(f"{store_dir}: {store.reencode(mode)}")
        elif action == "verify":
            print(store.verify())
        elif action == "repair":
            report = store.repair()
            print(f"repaired {store_dir}: {report}")
            if hint := report.restore_hint(store_dir):
                print(hint)
        elif action == "recode":
            before, began = bytes_on_disk(store_dir), time.perf_counter()
            after = store.recode(codec or "raw")
            seconds = time.perf_counter() - began
            tokens = sum(c.n_tokens for c in store.manifest.chunks.values())
            print(f"re-encoded {store_dir} as {codec}: {before / 2**20:.1f} -> {after / 2**20:.1f} MiB on disk "
                  f"({after / max(tokens, 1):,.0f} B/token, {tokens:,} tokens, {seconds:.0f} s)")  # fmt: skip
            if json_out is not None:
                record = {"codec": codec or "raw", "chunks": len(store), "tokens": tokens, "bytes_before": before,
                          "bytes_after": after, "bytes_per_token": after / max(tokens, 1), "seconds": seconds,
                          "tokens_per_s": tokens / seconds}  # fmt: skip
                json_out.write_text(json.dumps(record, indent=2) + "\n")
        else:
            print(f"compacted {store_dir}: freed {store.compact() / 2**20:.1f} MiB")


def ask(lm: LoadedModel, store_dir: Path, question: str, *, k: int, mode: str | None, compare_full: bool,
        max_new_tokens: int, **module_options: object) -> None:  # fmt: skip
    """Answer ``question`` from the store; print the answer, its sources and TTFT (and full prefill's).
    ``module_options`` are ``DocumentStore.load``'s ``modules`` and ``recompute_missing``."""
    store = DocumentStore.load(store_dir, engine_for(lm), **module_options)
    if not store.manifest.docs:
        msg = (f"the store at {store_dir} has no committed documents yet (if `pc-rag index` is building it, it may "
               f"still be running: it commits every {COMMIT_EVERY_CHUNKS} chunks or {COMMIT_EVERY_SECONDS:.0f} s); "
               "ask again when it has")  # fmt: skip
        raise StoreError(msg)
    if k > len(store):  # a small store: read all of it, as a user asking for "up to k" sources expects
        print(f"note: the store holds {len(store)} chunks, fewer than k={k}: all of them are read", file=sys.stderr)
        k = len(store)
    server = PromptServer(store=store)
    warm_up(server, question, k=k, mode=mode, full=compare_full)
    answer = server.answer(question, k=k, mode=mode, max_new_tokens=max_new_tokens)
    print(answer.text.strip())
    print("\nsources:")
    for h in answer.sources:
        print(f"  [{h.score:.3f}] {source_line(h)}")
    for h in answer.skipped:
        print(f"  skipped, its KV is damaged: chunk {h.chunk_id} of {source_label(h)}")
    stats = answer.result.stats
    print(
        f"\nTTFT {stats.ttft_ms:.0f} ms cached ({stats.cached_tokens} cached, {stats.computed_tokens} computed tokens)"
    )
    if compare_full:
        full = server.answer_full(question, k=k, max_new_tokens=max_new_tokens)
        print(f"TTFT {full.result.stats.ttft_ms:.0f} ms full prefill; full prefill answered: {full.text.strip()!r}")


def source_label(handle: ModuleHandle) -> str:
    """What names a source for a reader: its title, else its file (``source``), else its document id."""
    return str(handle.metadata.get("title") or handle.metadata.get("source") or handle.doc_id)


def source_line(handle: ModuleHandle, width: int = 80) -> str:
    """``label: "snippet"``, the snippet on one line (line breaks and runs of spaces as one space)."""
    snippet = " ".join(handle.text.split())
    return f'{source_label(handle)}: "{snippet[:width]}{"…" if len(snippet) > width else ""}"'


def warm_up(server: PromptServer, question: str, *, k: int, mode: str | None, full: bool) -> None:
    """One untimed 1-token answer by the cached path (and by full prefill with ``full``), so that no timed answer
    pays a cold process's first call (kernel setup, allocations, the splice adapter's loading)."""
    server.answer(question, k=k, mode=mode, max_new_tokens=1)
    if full:
        server.answer_full(question, k=k, max_new_tokens=1)


def serve(lm: LoadedModel, store_dir: Path, *, host: str, port: int, mode: str | None, max_batch: int,
          queue_limit: int, api_key: str | None = None, prefix_cache_mb: int = 512,
          **module_options: object) -> None:  # fmt: skip
    """Serve the store over HTTP (OpenAI-compatible routes and /v1/rag) until interrupted.

    The scheduler serves on this thread, which loaded the model; uvicorn runs beside it (``Scheduler.run``)."""
    try:
        import uvicorn
    except ImportError as e:
        msg = "`pc-rag serve` needs FastAPI and uvicorn: pip install 'pc-rag[serve]'"
        raise PCRagError(msg) from e
    from pc_rag.runtime.prefix_cache import PrefixCache
    from pc_rag.runtime.scheduler import Scheduler
    from pc_rag.server.http import create_app
    from pc_rag.store.chunk_kv import open_chunk_shards

    store = DocumentStore.load(store_dir, engine_for(lm), **module_options)
    store.check_mode(mode)  # a store its mode cannot read is refused now, not at every request
    scheduler = Scheduler(lm, max_batch=max_batch, queue_limit=queue_limit)
    prefix_cache = PrefixCache(prefix_cache_mb * 2**20) if prefix_cache_mb else None
    served = PromptServer(store=store, mode=mode, scheduler=scheduler, prefix_cache=prefix_cache)
    app = create_app(served, api_key=api_key)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    key = "an API key" if api_key else "no API key"
    print(f"serving {store_dir} ({len(store)} chunks, {lm.name}) on http://{host}:{port}/v1 ({key})")

    def warm_then_serve() -> None:
        for problem in open_chunk_shards(store.kv):  # a shard's checksum, read once, is not a request's to pay
            print(f"warning: {problem}", file=sys.stderr)
        if len(store):  # nor are the cold process's first calls
            try:
                served.answer_chat([("user", "What is this about?")], k=min(3, len(store)), max_new_tokens=2)
            except PCRagError as e:  # the requests will say it again, each to its client
                print(f"warning: the warm-up request failed: {e}", file=sys.stderr)
        server.run()

    try:
        scheduler.run(warm_then_serve)
    except KeyboardInterrupt:
        server.should_exit = True


def model_note(lm: LoadedModel) -> str:
    """One line on the model answering: its size, and how to load a larger one."""
    params = sum(p.numel() for p in lm.model.parameters())
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    return (f"answers by {lm.name} ({size} parameters; a small model is often wrong): load a larger one with "
            "`pc-rag --model DIR` (a local Hugging Face directory; docs/cli.md#a-larger-local-model)")  # fmt: skip


def demo(lm: LoadedModel, questions: int) -> None:
    """Build a store from the bundled HotpotQA sample, then answer sample questions cached and by full prefill."""
    from pc_rag.hotpotqa_sample import sample_questions

    sample = sample_questions()[: max(questions, 10)]  # the asked questions' passages plus other questions' as noise
    with tempfile.TemporaryDirectory(prefix="pc-rag-demo-") as tmp:
        print(f"building a store from {sum(len(q.passages) for q in sample)} bundled HotpotQA passages ...")
        store = DocumentStore.create(Path(tmp) / "store", engine_for(lm))
        docs = {f"{t}\n{x}": {"title": t} for q in sample for t, x in q.passages}
        store.add_documents(list(docs.items()))
        server = PromptServer(store=store)
        warm_up(server, sample[0].question, k=5, mode=None, full=True)
        print(model_note(lm))
        print(f"{'question':<58} {'cached':>8} {'full':>8}  answer (cached | full) [gold]")
        for q in sample[:questions]:
            cached = server.answer(q.question, k=5, max_new_tokens=24)
            full = server.answer_full(q.question, k=5, max_new_tokens=24)
            print(f"{q.question[:58]:<58} {cached.result.stats.ttft_ms:>6.0f}ms {full.result.stats.ttft_ms:>6.0f}ms  "
                  f"{cached.text.strip()!r} | {full.text.strip()!r} [{q.answers[0]}]")  # fmt: skip
