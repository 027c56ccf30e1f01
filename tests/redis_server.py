"""A real ``redis-server`` for tests: started on a free loopback port in a temporary directory.

No mocks: the Redis tier's tests talk to the real server (``ragblend.bench.redis_servers``
starts it). When ``redis-server`` is missing the fixture fails loudly (``make install`` installs
it); set ``RAGBLEND_SKIP_REDIS=1`` to skip instead.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from ragblend.bench import redis_servers
from ragblend.bench.redis_servers import free_port

__all__ = ["RedisServer", "free_port", "redis_server", "server_binary", "shared_redis_server"]


def server_binary() -> str:
    """Path of redis-server (or valkey-server); fails the test when neither is installed."""
    try:
        return redis_servers.find_binary("redis-server", "valkey-server")
    except FileNotFoundError as exc:
        if os.environ.get("RAGBLEND_SKIP_REDIS"):
            pytest.skip("redis-server not installed (RAGBLEND_SKIP_REDIS is set)")
        pytest.fail(f"{exc} (apt-get install redis-server)")


class RedisServer(redis_servers.RedisServer):
    """One redis-server process; ``stop()``/``start()`` kill and restart it on the same port."""

    def __init__(self, directory: Path, **options) -> None:
        super().__init__(directory, binary=server_binary(), **options)


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
