"""The Redis module store against a real redis-server on loopback: round trips, damage, outage, out of memory."""

from __future__ import annotations

import pytest
import redis

from pc_rag.errors import ModuleCorruptedError, ModuleStoreFullError, ModuleStoreUnavailableError
from pc_rag.modules.interface import ModuleStore
from pc_rag.modules.keys import Encoding, ModuleKey
from pc_rag.modules.redis_store import RedisModuleStore
from pc_rag.scaleout.local_redis import RedisServer

ENCODING = Encoding("preamble-sha", 256, 32, 512, True, "cachegen:01c01df40d8219f0:4")


@pytest.fixture
def store(redis_url):
    with RedisModuleStore(redis_url) as s:
        yield s


def test_modules_round_trip_singly_and_in_batches(store: RedisModuleStore) -> None:
    assert isinstance(store, ModuleStore)
    store.put("a", b"\x00module a")
    store.put_many({"b": b"", "c": bytes(range(256)) * 100})
    assert store.get("a") == b"\x00module a" and store.get("missing") is None
    assert store.get_many(["c", "missing", "b"]) == [bytes(range(256)) * 100, None, b""]
    assert store.contains_many(["a", "x", "c"]) == [True, False, True]
    assert store.delete("a") and not store.delete("a") and store.delete_many(["b", "c", "zz"]) == 2
    assert store.get_many([]) == [] and store.contains_many([]) == []


def test_a_damaged_or_foreign_value_is_refused(redis_server, store: RedisModuleStore) -> None:
    store.put("m", b"the module's bytes")
    client = redis.Redis.from_url(redis_server.url)
    framed = client.get("m")
    client.set("m", framed[:-1] + bytes([framed[-1] ^ 1]))
    with pytest.raises(ModuleCorruptedError, match="checksum"):
        store.get("m")
    client.set("other", b"written by someone else")
    with pytest.raises(ModuleCorruptedError, match="not a pc-rag module"):
        store.get("other")


def test_a_stopped_server_is_a_clear_error_and_a_restarted_one_serves_again(tmp_path) -> None:
    server = RedisServer(tmp_path).start()
    with RedisModuleStore(server.url, timeout_s=1.0) as store:
        store.put("k", b"v")
        server.stop()
        with pytest.raises(ModuleStoreUnavailableError, match=f"127.0.0.1:{server.port}"):
            store.get("k")
        server.start()  # no persistence: the restarted server is empty, and says so
        assert store.get("k") is None
        store.put("k", b"v2")
        assert store.get("k") == b"v2"
    server.stop()


def test_out_of_memory_is_a_clear_error_and_writes_nothing(tmp_path) -> None:
    server = RedisServer(tmp_path, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction").start()
    try:
        with RedisModuleStore(server.url) as store:
            store.put("small", b"kept")
            with pytest.raises(ModuleStoreFullError, match="out of memory"):
                store.put_many({"big1": bytes(3 << 20), "big2": b"x"})
            assert store.get_many(["small", "big1", "big2"]) == [b"kept", None, None]
    finally:
        server.stop()


def test_keys_name_the_model_the_encoding_and_the_tokens() -> None:
    key = ModuleKey.of("model-fp", ENCODING, [1, 2, 3])
    assert key.name.startswith("pc-rag/v1/model-fp/") and key == ModuleKey.of("model-fp", ENCODING, (1, 2, 3))
    others = [
        ModuleKey.of("other-model", ENCODING, [1, 2, 3]),
        ModuleKey.of("model-fp", ENCODING, [1, 2, 4]),
        ModuleKey.of("model-fp", Encoding("preamble-sha", 256, 32, 512, True, "bfloat16"), [1, 2, 3]),
        ModuleKey.of("model-fp", Encoding("preamble-sha", 256, 32, 512, False, ENCODING.storage), [1, 2, 3]),
    ]
    assert len({key.name, *(k.name for k in others)}) == 5
