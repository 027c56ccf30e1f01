"""Reaching a Redis/Valkey server, or a whole Redis Cluster from the URL of any of its nodes.

:class:`RedisConnection` makes the client once: a plain client for the URL, upgraded on first
contact to redis-py's ``RedisCluster`` when the server says it is a cluster node (``INFO
cluster``). Every call goes through :meth:`RedisConnection.call`: a server that cannot be reached
raises :class:`Unreachable`, is logged once per outage and is not asked again for ``retry_s``
seconds. In a cluster the outage is the node that serves the call's key, so a shard that is down
costs the keys of its slots only; MOVED/ASK redirections and a failover's new master are the
cluster client's to follow.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ragblend.errors import RagblendError
from ragblend.redact import redact_url, scrub

log = logging.getLogger("ragblend.store.redis")
T = TypeVar("T")


def redis_module() -> Any:
    """redis-py, or one clear error naming the extra that installs it."""
    try:
        import redis
    except ImportError:
        msg = "the Redis tier needs redis-py: pip install 'ragblend[redis]'"
        raise RagblendError(msg) from None
    return redis


class Unreachable(Exception):
    """The server (or the cluster node that holds a key) could not be reached, or is inside
    its retry back-off."""


class RedisConnection:
    """The client for ``url`` (``redis://``, ``rediss://`` or ``unix://``) and its outages.

    ``options`` are redis-py's connection keywords (timeouts, pool size, read size, password);
    ``url`` (the attribute) and every message show the URL with its credentials masked.
    """

    def __init__(self, url: str, retry_s: float = 1.0, **options: Any) -> None:
        redis = redis_module()
        self._url = url
        self.url = redact_url(url)
        self.retry_s = float(retry_s)
        self.last_error: str | None = None
        self.cluster: bool | None = None  # None until the server has said (first contact)
        self.errors: tuple[type[BaseException], ...] = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
            redis.exceptions.RedisClusterException,
            OSError,
        )
        self.redis_error: type[Exception] = redis.exceptions.RedisError
        self._options = options
        try:
            self._client = redis.Redis.from_url(url, retry_on_timeout=False, **options)
        except (ValueError, TypeError) as exc:
            raise RagblendError(f"invalid Redis URL {self.url!r}: {self.scrub(exc)}") from None
        self._down_until: dict[str | None, float] = {}  # node name (None: the server) → until
        self._down_logged: set[str | None] = set()
        self._state = threading.Lock()
        self._connecting = threading.Lock()

    def scrub(self, error: object) -> str:
        """``error``'s text with this URL's credentials masked (for logs and messages)."""
        return scrub(error, self._url)

    @property
    def client(self) -> Any:
        """The client: on first contact, a ``RedisCluster`` when the server is a cluster node,
        else the plain client (raises redis-py's connection errors when it cannot tell)."""
        if self.cluster is not None:
            return self._client
        with self._connecting:
            if self.cluster is None:
                try:
                    enabled = bool(self._client.info("cluster").get("cluster_enabled"))
                except self.redis_error as exc:
                    if isinstance(exc, self.errors):
                        raise
                    enabled = False  # e.g. INFO not allowed for this user: a plain server
                if enabled:
                    from redis.cluster import RedisCluster

                    cluster = RedisCluster.from_url(self._url, **self._options)
                    self._client.close()
                    self._client = cluster
                self.cluster = enabled
        return self._client

    def is_cluster(self) -> bool | None:
        """Whether the server is a Redis Cluster node (None while it has never answered)."""
        if self.cluster is None:
            try:
                self.call(lambda c: None)
            except (Unreachable, self.redis_error):
                pass
        return self.cluster

    def node_of(self, key: str | None) -> str | None:
        """Which outage a call for Redis key ``key`` counts against: the cluster node that
        serves its slot, else None (the one server, or a call of no single key)."""
        if not self.cluster or key is None:
            return None
        try:
            return self._client.get_node_from_key(key).name
        except Exception:  # the slot map is being rebuilt: the whole cluster's state
            return None

    def call(self, fn: Callable[[Any], T], key: str | None = None) -> T:
        """``fn(client)`` for a call about Redis key ``key`` (or none); a dead server, or in a
        cluster the dead node serving ``key``, raises :class:`Unreachable` (logged once per
        outage, then not asked for ``retry_s``: the other nodes keep serving)."""
        node = self.node_of(key)
        if time.monotonic() < self._down_until.get(node, 0.0):
            raise Unreachable
        where = self.url if node is None else f"{self.url} (cluster node {node})"
        try:
            result = fn(self.client)
        except self.errors as exc:
            reason = self.scrub(exc)
            with self._state:
                self._down_until[node] = time.monotonic() + self.retry_s
                first = node not in self._down_logged
                self._down_logged.add(node)
                self.last_error = reason
            if first:
                log.warning(
                    "Redis KV tier at %s is unreachable (%s): chunk KV lookups are misses "
                    "(recomputed) until it is back",
                    where,
                    reason,
                )
            raise Unreachable from None
        if node in self._down_logged:
            with self._state:
                self._down_logged.discard(node)
            log.warning("Redis KV tier at %s is reachable again", where)
        return result

    def close(self) -> None:
        self._client.close()
