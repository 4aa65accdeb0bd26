"""Indexing on a real local Ray cluster (a head and a second node on this machine, one CPU each, two
single-thread actors) into a real Redis: the same KV and index as encoding in-process, resumable by content
hash, and complete with nothing lost or repeated when an actor is killed mid-job."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import redis
import torch
from conftest import tiny_model
from test_document_store import embedder

from pc_rag.model import load_model
from pc_rag.rag import RagEngine, RagPrompt
from pc_rag.scaleout import EncoderSpec, RayChunkWorkers
from pc_rag.store.document_store import DocumentStore

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import dying_encoder  # noqa: E402

DOCS = [(f"Document {i} tells of the river {i}, which flows {i * 3} miles past the town of Town{i} into the "
         f"lake {i % 5}. Fishermen there catch fish number {i * 7} in spring.", {}) for i in range(24)]  # fmt: skip


@pytest.fixture(scope="module")
def engine(tokenizer, tmp_path_factory) -> RagEngine:
    """A tiny random model saved to disk, so that every actor loads exactly these weights."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    lm = tiny_model("llama", tokenizer)
    lm.model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return RagEngine(load_model(str(directory)), RagPrompt())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    marker = tmp_path_factory.mktemp("marker") / "died"
    os.environ[dying_encoder.MARKER_ENV] = str(marker)  # the nodes' workers inherit it
    ray.cloudpickle.register_pickle_by_value(dying_encoder)  # actors need not import the tests
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 << 20})
    nodes.add_node(num_cpus=1, object_store_memory=80 << 20)
    ray.init(address=nodes.address, log_to_driver=False)
    yield marker
    ray.shutdown()
    nodes.shutdown()


def create(directory: Path, engine: RagEngine, url: str | None) -> DocumentStore:
    return DocumentStore.create(directory, engine, embedder=embedder(), chunk_tokens=24, overlap_tokens=4,
                                modules=url)  # fmt: skip


def workers(store: DocumentStore, **kwargs) -> RayChunkWorkers:
    return RayChunkWorkers(EncoderSpec.of(store), actors=2, batch_size=4, embedder=store.embedder, **kwargs)


def kv_by_content(store: DocumentStore) -> dict[str, torch.Tensor]:
    ids = sorted(store.manifest.chunks)
    chunks = store.chunks([store.handle(c) for c in ids])
    return {store.manifest.chunks[c].content_hash: chunk.kv.keys for c, chunk in zip(ids, chunks, strict=True)}


def test_ray_actors_encode_what_the_store_would(tmp_path, engine, redis_url, cluster) -> None:
    with create(tmp_path / "local", engine, None) as local, create(tmp_path / "ray", engine, redis_url) as remote:
        local.add_documents(DOCS, progress=False)
        remote.add_documents(DOCS, progress=False, workers=workers(remote))
        assert len(remote) == len(local) and sorted(remote.index.ids()) == sorted(remote.manifest.chunks)
        expected, got = kv_by_content(local), kv_by_content(remote)
        assert expected.keys() == got.keys()
        for key, keys in expected.items():
            torch.testing.assert_close(got[key], keys)  # fp32 tolerance: other batches, one thread
        question = "Which river flows past Town7?"
        assert [h.text for h in remote.search(question, k=3)] == [h.text for h in local.search(question, k=3)]


def test_a_rerun_encodes_only_what_is_missing(tmp_path, engine, redis_url, cluster) -> None:
    with create(tmp_path / "first", engine, redis_url) as first:
        first.add_documents(DOCS[:10], progress=False, workers=workers(first))
    client = redis.Redis.from_url(redis_url)
    written = set(client.keys())
    with create(tmp_path / "second", engine, redis_url) as second:
        spec = EncoderSpec.of(second)
        jobs = []

        class Recording(RayChunkWorkers):
            def run(self, chunks):
                jobs.extend(chunks)
                return super().run(chunks)

        second.add_documents(DOCS, progress=False, workers=Recording(spec, actors=2, embedder=second.embedder))
        encoded = {c.content_hash for c in jobs if c.encode}
        assert len(jobs) == len(second) and len(encoded) == len(set(client.keys()) - written) > 0
        first_hashes = {r.content_hash for r in DocumentStore.load(tmp_path / "first", engine, embedder=embedder())
                        .manifest.chunks.values()}  # fmt: skip
        assert not encoded & first_hashes


def test_a_killed_actor_loses_and_repeats_nothing(tmp_path, engine, redis_url, cluster) -> None:
    with create(tmp_path / "store", engine, redis_url) as store:
        store.add_documents(DOCS, progress=False, workers=workers(store, encoder=dying_encoder.DyingEncoder))
        assert cluster.exists()  # an actor did die mid-job
        ids = store.index.ids()
        assert len(ids) == len(set(ids)) == len(store) and set(ids) == set(store.manifest.chunks)
        hashes = {r.content_hash for r in store.manifest.chunks.values()}
        assert redis.Redis.from_url(redis_url).dbsize() == len(hashes)
        assert store.verify()
    with create(tmp_path / "local", engine, None) as local:
        local.add_documents(DOCS, progress=False)
        expected = kv_by_content(local)
    with DocumentStore.load(tmp_path / "store", engine, embedder=embedder()) as again:
        for key, keys in kv_by_content(again).items():
            torch.testing.assert_close(keys, expected[key])


def test_workers_that_cannot_reach_the_module_store_fail_clearly_and_commit_nothing(
    tmp_path, engine, redis_url, cluster
) -> None:
    from dataclasses import replace

    from pc_rag.errors import ModuleStoreUnavailableError

    with create(tmp_path / "store", engine, redis_url) as store:
        spec = replace(EncoderSpec.of(store), modules="redis://127.0.0.1:1/0")  # no server there
        lost = RayChunkWorkers(spec, actors=2, batch_size=4, embedder=store.embedder, max_retries=0)
        with pytest.raises(ModuleStoreUnavailableError, match=r"127\.0\.0\.1:1/0 is unreachable"):
            store.add_documents(DOCS[:4], progress=False, workers=lost)
        assert len(store) == 0 and store.manifest.docs == {} and redis.Redis.from_url(redis_url).dbsize() == 0
