"""A separate process that writes to, or reads from, a document store, for the crash and concurrency tests.

``write``: add ``--docs`` documents to the store (creating it), a commit every ``--commit-every`` chunks,
optionally killing itself with SIGKILL (as ``kill -9`` would) at the n-th call of a write step
(``--kill-at shard:2``, ``index:3``, ``manifest:2``, ``after-manifest:2``). ``--update`` first commits the
documents, then rewrites each with new text. ``read``: ask in a loop until ``--until`` exists, printing
``ok N`` or the first error.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import tiny_model, tiny_tokenizer
from test_document_store import embedder

from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.server.prompt_server import PromptServer
from pc_rag.store.document_store import DocumentStore
from pc_rag.store.index import VectorIndex
from pc_rag.store.kvstore import KVStore
from pc_rag.store.manifest import MANIFEST_NAME, Manifest

TOPICS = ["river", "mountain", "tower", "forest", "desert", "island", "glacier", "canyon", "volcano", "lake"]


def document(i: int, version: int = 0) -> str:
    """Document ``i``: a few sentences about one topic, long enough for two or three chunks."""
    topic = TOPICS[i % len(TOPICS)]
    return (
        f"Document {i} (version {version}) is about the {topic} number {i}. The {topic} {i} is famous for its "
        f"colour, which is shade {i * 7 + version}. Visitors to the {topic} {i} come in spring and autumn."
    )


def engine() -> RagEngine:
    return RagEngine(tiny_model("llama", tiny_tokenizer()), RagPrompt())


def open_store(path: Path, eng: RagEngine) -> DocumentStore:
    if (path / MANIFEST_NAME).exists():
        return DocumentStore.load(path, eng, embedder=embedder())
    return DocumentStore.create(path, eng, embedder=embedder(), chunk_tokens=24, overlap_tokens=4)


def kill_at(owner: type, name: str, nth: int, after: bool = False) -> None:
    """Make the ``nth`` call of ``owner.name`` kill this process, before it runs (or just after)."""
    original = getattr(owner, name)
    calls = [0]

    @functools.wraps(original)
    def wrapper(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        if calls[0] == nth and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        out = original(*args, **kwargs)
        if calls[0] == nth and after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(owner, name, wrapper)


def write(args: argparse.Namespace) -> None:
    eng = engine()
    docs = [(document(i), {"n": i}) for i in range(args.docs)]
    ids = [f"doc{i}" for i in range(args.docs)]
    store = open_store(args.store, eng)
    if args.update:
        store.add_documents(docs, ids, progress=False, commit_every=args.commit_every)
        docs = [(document(i, version=1), {"n": i}) for i in range(args.docs)]
    if args.kill_at:
        step, nth = args.kill_at.split(":")
        target = {
            "shard": (KVStore, "_write_shard", False),
            "index": (VectorIndex, "save", False),
            "manifest": (Manifest, "save", False),
            "after-manifest": (Manifest, "save", True),
        }[step]
        kill_at(target[0], target[1], int(nth), after=target[2])
    store.add_documents(docs, ids, progress=False, commit_every=args.commit_every)
    store.close()
    print("done", flush=True)


def read(args: argparse.Namespace) -> None:
    eng = engine()
    asked = 0
    while not args.until.exists():
        if not (args.store / MANIFEST_NAME).exists():
            time.sleep(0.05)
            continue
        try:
            with open_store(args.store, eng) as store:
                for handle in store.search("Which lake is famous for its colour?", k=3):
                    assert handle.chunk_id in store.manifest.chunks
                if len(store):
                    PromptServer(store=store).answer("Which river is famous?", k=2, mode="naive", max_new_tokens=2)
                asked += 1
        except Exception:  # noqa: BLE001 - the test reads what went wrong
            print("error", traceback.format_exc().replace("\n", " | "), flush=True)
            return
    print(f"ok {asked}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["write", "read"])
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--commit-every", type=int, default=4)
    parser.add_argument("--kill-at", default=None)
    parser.add_argument("--update", action="store_true")
    parser.add_argument("--until", type=Path, default=None)
    args = parser.parse_args()
    write(args) if args.action == "write" else read(args)


if __name__ == "__main__":
    main()
