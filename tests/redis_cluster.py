"""A real Redis Cluster for tests: three masters with a replica each, every node a
``redis-server`` process (``ragblend.bench.redis_servers``), joined by ``redis-cli --cluster
create``. No mocks: the cluster tier's tests kill masters and shards and migrate slots."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_server import server_binary

from ragblend.bench.redis_servers import RedisClusterNodes, find_binary

__all__ = ["RedisClusterNodes", "redis_cluster", "shared_redis_cluster"]


def _nodes(directory: Path) -> RedisClusterNodes:
    server_binary()  # fails, or skips with RAGBLEND_SKIP_REDIS, as one server does
    try:
        find_binary("redis-cli", "valkey-cli")
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    return RedisClusterNodes(directory)


@pytest.fixture
def redis_cluster(tmp_path) -> Iterator[RedisClusterNodes]:
    """A fresh three-master Redis Cluster (one replica each) for one test."""
    with _nodes(tmp_path) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def shared_redis_cluster() -> Iterator[RedisClusterNodes]:
    """One three-master cluster for a module (tests use distinct namespaces)."""
    with tempfile.TemporaryDirectory(prefix="ragblend-cluster-") as d, _nodes(Path(d)) as cluster:
        yield cluster
