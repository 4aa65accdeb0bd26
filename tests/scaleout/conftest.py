"""One real ``redis-server`` per test module on a free loopback port, and its address flushed for each test."""

from __future__ import annotations

import pytest
import redis

from pc_rag.scaleout.local_redis import RedisServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield started
    started.stop()


@pytest.fixture
def url(server) -> str:
    """The server's address, emptied first."""
    redis.Redis.from_url(server.url).flushdb()
    return server.url
