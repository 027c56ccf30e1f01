"""A real ``redis-server`` for tests: started on a free loopback port in a temporary directory.

No mocks: the Redis tier's tests talk to the real server. When ``redis-server`` is missing the
fixture fails loudly (``make install`` installs it); set ``RAGBLEND_SKIP_REDIS=1`` to skip instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_binary() -> str:
    """Path of redis-server (or valkey-server); fails the test when neither is installed."""
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("RAGBLEND_SKIP_REDIS"):
        pytest.skip("redis-server not installed (RAGBLEND_SKIP_REDIS is set)")
    pytest.fail("redis-server is not installed: run `make install` (apt-get install redis-server)")


class RedisServer:
    """One redis-server process; ``stop()``/``start()`` kill and restart it on the same port.

    ``password`` alone sets ``requirepass`` (the default user's password); with ``username``
    too it adds that ACL user (all keys and commands) and turns the default user off.
    """

    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        maxmemory: str | None = None,
        extra: list[str] | None = None,
        password: str | None = None,
        username: str | None = None,
    ):
        self.dir = Path(directory)
        self.extra = list(extra or [])
        self.port = port or free_port()
        self.maxmemory = maxmemory
        self.password = password
        self.username = username
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The server's URL, credentials included."""
        auth = ""
        if self.password:
            auth = f"{self.username or ''}:{self.password}@"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _auth_args(self) -> list[str]:
        if self.password and self.username:
            acl = [self.username, "on", f">{self.password}", "~*", "&*", "+@all"]
            return ["--user", *acl, "--user", "default", "off"]
        if self.password:
            return ["--requirepass", self.password]
        return []

    def start(self) -> RedisServer:
        cmd = [
            server_binary(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
        ]
        cmd += self._auth_args() + self.extra
        if self.maxmemory:
            cmd += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited at start: {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError("redis-server did not answer PING within 20 s")

    def stop(self) -> None:
        """Kill the server (SIGKILL: an abrupt death, as in a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture
def redis_server(tmp_path):
    """A fresh, empty redis-server for one test."""
    with RedisServer(tmp_path) as server:
        yield server


@pytest.fixture(scope="module")
def shared_redis_server():
    """One redis-server for a module (tests use distinct namespaces/prefixes)."""
    with tempfile.TemporaryDirectory(prefix="ragblend-redis-") as d, RedisServer(Path(d)) as server:
        yield server
