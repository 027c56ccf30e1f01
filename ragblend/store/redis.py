"""Shared KV tier on Redis or Valkey: one hash per entry, one round trip per layer.

Layout of an entry (one Redis hash, so Redis's own ``maxmemory`` LRU evicts metadata and data
together, never one without the other)::

    {prefix}[:{namespace}]:{chunk key}
        header  JSON: format version, key, the entry's meta (fingerprint, dtype, kv_dtype,
                compute_dtype, tokens, context), layer count, token count, bytes, per-layer
                xxh3 checksums
        L{i}    layer i's stored tensors (``entry.stored_layer(i)``) as safetensors bytes

``get`` reads the header only. The layer loader's reader thread calls ``fetch_layers(entries,
i)``: layer ``i`` (and the next ``layers_per_fetch - 1``) of every entry of the query in one
pipelined round trip, verified and parsed there, so a query costs about ``num_layers`` round
trips, overlapped with compute. ``RedisEntry.layer(i)`` alone fetches one entry's layer.
The store is a cache: a missing, evicted, foreign or corrupt entry and an unreachable server are
misses (``CorruptEntryError`` from ``layer(i)`` mid-prefill: the engine discards and recomputes).
Writes go through a background thread with a bounded queue, so ``put`` never waits for Redis.

**Redis Cluster**: a URL of any node of a cluster uses the whole cluster, detected from the
server (``INFO cluster``) on first contact, through redis-py's ``RedisCluster`` (which follows
MOVED/ASK redirections and a failover's new master). An entry is one hash, so its layers live on
one shard; a layer read of a query's entries is one pipeline per shard that holds some of them;
a shard that is down makes its entries misses (recomputed) while the other shards keep hitting.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
from collections.abc import Iterator, Sequence

from safetensors.torch import load as st_load

from ragblend.errors import CorruptEntryError, RagblendError
from ragblend.redact import redact_url
from ragblend.store.base import KVEntry, StoreStats
from ragblend.store.redis_client import RedisConnection, Unreachable
from ragblend.store.redis_entry import (
    CHECKSUM,
    FORMAT_VERSION,
    HEADER,
    RedisEntry,
    checksum,
    encode_entry,
    layer_field,
)
from ragblend.threads import copy_only_thread

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "ragblend:kv"
PASSWORD_ENV = "RAGBLEND_REDIS_PASSWORD"
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_STOP = object()


class RedisStore:
    """KV tier in a Redis/Valkey server shared by many processes (see the module docstring).

    ``url``: ``redis://[user:password@]host:port/db``, ``rediss://`` (TLS) or
    ``unix:///path.sock``. ``password``: used when the URL carries none (default:
    ``$RAGBLEND_REDIS_PASSWORD``), so a secret need not be on a command line.
    ``namespace`` partitions the key space per tenant (``BlendConfig.namespace`` already salts
    every key; this also lets ``ragblend cache`` count and drop one tenant's entries).
    The ``url`` attribute, logs, errors and the repr show the URL with its user name and
    password masked (``ragblend.redact``).
    """

    tier = "redis"
    prefetch_depth = 2

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        namespace: str | None = None,
        prefix: str = DEFAULT_PREFIX,
        socket_timeout: float = 2.0,
        connect_timeout: float = 1.0,
        retry_s: float = 1.0,
        max_connections: int = 16,
        max_pending_writes: int = 64,
        block_when_full: bool = False,
        layers_per_fetch: int = 4,
        ttl_s: int | None = None,
        socket_read_size: int = 1 << 20,
        password: str | None = None,
    ) -> None:
        shown = redact_url(url)
        if not url.startswith(("redis://", "rediss://", "unix://")):
            raise RagblendError(
                f"Redis URL {shown!r} must start with redis://, rediss:// or unix://"
            )
        for what, name in (("namespace", namespace), ("prefix", prefix.replace(":", "_"))):
            if name is not None and not _NAME.match(name):
                raise RagblendError(f"{what} {name!r}: use letters, digits, '_', '.', '-'")
        if password is None:
            password = os.environ.get(PASSWORD_ENV) or None
        self.connection = RedisConnection(
            url,
            retry_s,
            socket_timeout=socket_timeout,
            socket_connect_timeout=connect_timeout,
            max_connections=max_connections,
            # A layer of a query's chunks is megabytes: with 64 KiB reads (redis-py's
            # default) a pipelined read of 6 × 393 KB took ~1.4x as long on loopback.
            socket_read_size=socket_read_size,
            **({"password": password} if password else {}),  # the URL's wins
        )
        self.url = shown
        self.namespace = namespace
        self.prefix = prefix
        self.layers_per_fetch = max(1, int(layers_per_fetch))
        self.ttl_s = ttl_s
        self.block_when_full = block_when_full
        self.stats = StoreStats()
        self.write_errors = 0
        self.dropped_writes = 0
        self.bytes_written = 0
        self.layer_round_trips = 0  # layer reads sent (each one pipeline, any entry count)
        self._redis_error = self.connection.redis_error
        self._warned: set[str] = set()
        self._state = threading.Lock()
        self._pending: dict[str, KVEntry] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_pending_writes))
        self._writer: threading.Thread | None = None

    # ------------------------------------------------------------------ connection
    def _scrub(self, error: object) -> str:
        """``error``'s text with this store's credentials masked (for logs and messages)."""
        return self.connection.scrub(error)

    def redis_key(self, key: str) -> str:
        return f"{self.prefix}:{self.namespace}:{key}" if self.namespace else f"{self.prefix}:{key}"

    @property
    def client(self):
        """The redis-py client (a ``RedisCluster`` on a cluster), for maintenance and tests."""
        return self.connection.client

    @property
    def last_error(self) -> str | None:
        return self.connection.last_error

    @last_error.setter
    def last_error(self, reason: str | None) -> None:
        self.connection.last_error = reason

    def is_cluster(self) -> bool | None:
        """Whether the server is a Redis Cluster node (None while it has never answered)."""
        return self.connection.is_cluster()

    def _node_of(self, key: str | None) -> str | None:
        return self.connection.node_of(key)

    def _call(self, fn, key: str | None = None):
        return self.connection.call(fn, key)

    def ping(self) -> bool:
        try:
            return bool(self._call(lambda c: c.ping()))
        except (Unreachable, self._redis_error):
            return False

    # ------------------------------------------------------------------ reads
    def __contains__(self, key: str) -> bool:
        if key in self._pending:
            return True
        try:
            name = self.redis_key(key)
            return bool(self._call(lambda c: c.hexists(name, HEADER), name))
        except (Unreachable, self._redis_error):
            return False

    def get(self, key: str) -> KVEntry | None:
        """The entry (header read, layers fetched lazily), or None on a miss."""
        pending = self._pending.get(key)
        if pending is not None:
            self.stats.count("hits")
            return pending
        entry = self._read_header(key)
        self.stats.count("hits" if entry is not None else "misses")
        return entry

    def _read_header(self, key: str) -> RedisEntry | None:
        try:
            name = self.redis_key(key)
            raw = self._call(lambda c: c.hget(name, HEADER), name)
        except (Unreachable, self._redis_error):
            return None
        if raw is None:
            return None
        try:
            header = json.loads(raw)
            if header.get("format") != FORMAT_VERSION:
                self._warn_once(key, f"format {header.get('format')!r} is not {FORMAT_VERSION}")
                return None  # another version's entry: leave it to its writer
            if header["key"] != key or len(header["sums"]) != int(header["layers"]):
                raise ValueError("header does not describe this entry")
            if header.get("checksum") != CHECKSUM or not isinstance(header["meta"], dict):
                raise ValueError("unknown checksum or metadata")
        except (ValueError, KeyError, TypeError) as exc:
            self.drop(key, f"bad header: {exc}")
            return None
        return RedisEntry(self, key, header)

    def _warn_once(self, key: str, reason: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("Redis KV entry %s… is unusable (%s): treated as a miss", key[:16], reason)

    def fetch_layers(self, entries: Sequence[KVEntry], index: int) -> None:
        """Fetch layer ``index`` (and the next ``layers_per_fetch - 1``) of every entry in one
        pipelined round trip (one ``HMGET`` per entry), verified and parsed on the calling
        thread (the layer loader's reader), so each ``entry.layer(index)`` is then local.

        ``entries`` are this store's ``RedisEntry`` objects. Every entry of the batch is
        checked (bad data is dropped from Redis) before ``CorruptEntryError`` names the first
        that failed: an unreachable server, an entry evicted since its header was read, a
        value that fails its checksum or does not parse.
        """
        wants = []
        for entry in entries:
            if not isinstance(entry, RedisEntry) or entry._store is not self:
                raise TypeError(f"{entry!r} is not an entry of {self!r}")
            wanted = entry._wanted(index)
            if wanted:
                wants.append((entry, wanted))
        if not wants:
            return
        groups: dict[str | None, list[tuple[RedisEntry, list[int]]]] = {}
        for want in wants:  # one pipeline per cluster node (one in all on a plain server)
            groups.setdefault(self._node_of(self.redis_key(want[0].key)), []).append(want)
        first: CorruptEntryError | None = None
        for group in groups.values():
            try:
                self._fetch_group(group)
            except CorruptEntryError as exc:
                first = first or exc
        if first is not None:
            raise first

    def _fetch_group(self, wants: list[tuple[RedisEntry, list[int]]]) -> None:
        """One pipelined read of ``wants`` (entries on one server or cluster node)."""

        def read(c):
            pipe = c.pipeline(transaction=False)
            for entry, wanted in wants:
                pipe.hmget(self.redis_key(entry.key), [layer_field(i) for i in wanted])
            return pipe.execute(raise_on_error=False)

        try:
            replies = self._call(read, self.redis_key(wants[0][0].key))
        except Unreachable:
            raise CorruptEntryError(wants[0][0].key, "the Redis server is unreachable") from None
        except self._redis_error as exc:
            raise CorruptEntryError(
                wants[0][0].key, f"layer read failed: {self._scrub(exc)}"
            ) from None
        with self._state:
            self.layer_round_trips += 1
        first: CorruptEntryError | None = None
        for (entry, wanted), reply in zip(wants, replies, strict=True):
            try:
                if isinstance(reply, Exception):  # e.g. WRONGTYPE: something else at our key
                    reason = f"unreadable: {self._scrub(reply)}"
                    self.drop(entry.key, reason)
                    raise CorruptEntryError(entry.key, reason)
                entry._accept(wanted, reply)
            except CorruptEntryError as exc:
                first = first or exc
        if first is not None:
            raise first

    # ------------------------------------------------------------------ writes
    def put(self, key: str, kv: KVEntry) -> None:
        """Queue the entry for the background writer (never blocks unless ``block_when_full``)."""
        if isinstance(kv, RedisEntry) and kv._store is self:
            return
        with self._state:
            if key in self._pending:
                return
            self._pending[key] = kv
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_loop, daemon=True, name="ragblend-redis-writer"
                )
                self._writer.start()
        try:
            self._queue.put((key, kv), block=self.block_when_full)
        except queue.Full:
            with self._state:
                self._pending.pop(key, None)
                self.dropped_writes += 1

    def _write_loop(self) -> None:
        copy_only_thread()  # serialising copies tensors: no OpenMP team (ragblend.threads)
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                self._write(*item)
            finally:
                if item is not _STOP:
                    with self._state:
                        self._pending.pop(item[0], None)
                self._queue.task_done()

    def _write(self, key: str, kv: KVEntry) -> None:
        try:
            fields = encode_entry(key, kv)
        except Exception as exc:  # an entry that cannot be encoded is a bug: say so, keep going
            log.warning("cannot encode KV entry %s… for Redis: %s", key[:16], self._scrub(exc))
            self.write_errors += 1
            return
        name = self.redis_key(key)

        def write(c):
            pipe = c.pipeline(transaction=True)
            pipe.delete(name)
            pipe.hset(name, mapping=fields)
            if self.ttl_s:
                pipe.expire(name, int(self.ttl_s))
            pipe.execute()

        try:
            self._call(write, name)
        except Unreachable:
            self.write_errors += 1
            return
        except self._redis_error as exc:  # e.g. OOM with a noeviction policy
            self.write_errors += 1
            reason = self._scrub(exc)
            if self.last_error != reason:
                log.warning("Redis KV tier at %s refused a write: %s", self.url, reason)
            self.last_error = reason
            return
        self.bytes_written += sum(len(v) for v in fields.values())
        self.stats.count("puts")

    def flush(self) -> None:
        """Wait until every queued write has been sent (or failed)."""
        self._queue.join()

    def drop(self, key: str, reason: str | None = None) -> None:
        if reason:
            self._warn_once(key, reason)
        self.discard(key)

    def discard(self, key: str) -> None:
        try:
            name = self.redis_key(key)
            self._call(lambda c: c.delete(name), name)
        except (Unreachable, self._redis_error):
            pass

    def drop_page_cache(self) -> bool:
        """False: the Redis tier keeps nothing in this machine's files."""
        return False

    def close(self) -> None:
        """Finish queued writes, stop the writer and close the connection pool."""
        with self._state:
            writer, self._writer = self._writer, None
        if writer is not None:
            self._queue.put(_STOP)
            writer.join()
        self.connection.close()

    # ------------------------------------------------------------------ maintenance
    def keys(self) -> Iterator[str]:
        """Chunk keys stored under this store's prefix and namespace (SCAN, no blocking)."""
        start = len(self.redis_key(""))
        pattern = self.redis_key("*")
        for name in self._call(lambda c: list(c.scan_iter(match=pattern, count=500))):
            key = name.decode()[start:]
            if ":" not in key:  # names of another namespace under a bare prefix
                yield key

    def server_info(self) -> dict:
        """Memory and eviction figures of the server (``INFO memory`` / ``INFO stats``); of a
        cluster, summed over its masters (``masters``: how many; the policy of the first)."""
        names = (
            "used_memory",
            "maxmemory",
            "maxmemory_policy",
            "evicted_keys",
            "keyspace_hits",
            "keyspace_misses",
        )
        client = self._call(lambda c: c)
        if not self.connection.cluster:
            info = self._call(lambda c: {**c.info("memory"), **c.info("stats")})
            return {k: info.get(k) for k in names}
        masters = client.get_primaries()
        per_node = [
            self._call(lambda c, n=n: {**c.info("memory", target_nodes=n),
                                        **c.info("stats", target_nodes=n)})
            for n in masters
        ]  # fmt: skip
        counts = [k for k in names if k != "maxmemory_policy"]
        summed: dict = {k: sum(int(i.get(k) or 0) for i in per_node) for k in counts}
        summed["maxmemory_policy"] = per_node[0].get("maxmemory_policy") if per_node else None
        summed["masters"] = len(masters)
        return summed

    def check(self, key: str) -> str | None:
        """None when every layer of ``key`` reads and verifies, else why not (drops nothing)."""
        try:
            name = self.redis_key(key)
            raw = self._call(lambda c: c.hget(name, HEADER), name)
            header = json.loads(raw) if raw is not None else None
            if header is None:
                return "missing"
            if header.get("format") != FORMAT_VERSION:
                return f"foreign format {header.get('format')!r}"
            if header.get("key") != key:
                return "header names another key"
            for i, expected in enumerate(header["sums"]):
                blob = self._call(lambda c, i=i: c.hget(name, layer_field(i)), name)
                if blob is None:
                    return f"layer {i} is missing"
                if checksum(blob) != expected:
                    return f"layer {i} fails its checksum"
                st_load(blob)
        except (Unreachable, self._redis_error) as exc:
            return f"unreadable: {self._scrub(exc) or 'server unreachable'}"
        except Exception as exc:  # bad JSON, bad safetensors
            return f"unreadable: {self._scrub(exc)}"
        return None

    def __repr__(self) -> str:
        ns = f", namespace={self.namespace!r}" if self.namespace else ""
        return f"RedisStore({self.url!r}{ns})"
