"""The store flags the commands share (``--store-path``, ``--redis-url``, ``--namespace``,
``--store-bytes``) and the one function that turns them into a store.

``serve``, ``warmup``, ``cache`` and ``bench`` add them with :func:`add_store_arguments`
and open their store with :func:`open_store`; they differ only in the options they pass
(a RAM tier in front for a server, a reachable Redis for a warmup, an existing directory to
inspect).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

from ragblend.errors import RagblendError
from ragblend.store.base import KVStore

log = logging.getLogger(__name__)

DISK_HELP = "disk store directory (default: $RAGBLEND_HOME/kv, the one `ragblend warmup` writes)"
REDIS_HELP = "the shared Redis/Valkey tier instead (redis://, rediss:// or unix:// URL)"
NAMESPACE_HELP = "tenant namespace salting every KV key"


def add_store_arguments(
    parser: argparse.ArgumentParser,
    *,
    disk_help: str = DISK_HELP,
    redis_help: str = REDIS_HELP,
    namespace_help: str = NAMESPACE_HELP,
    redis_default: str | None = None,
    store_bytes: bool = False,
) -> None:
    """Add ``--store-path DIR``, ``--redis-url URL`` (exclusive of each other unless
    ``redis_default`` is given: then the URL is only read when a Redis tier is asked for),
    ``--namespace N`` and, with ``store_bytes``, ``--store-bytes N``."""
    group = parser if redis_default is not None else parser.add_mutually_exclusive_group()
    group.add_argument("--store-path", metavar="DIR", default=None, help=disk_help)
    group.add_argument("--redis-url", metavar="URL", default=redis_default, help=redis_help)
    parser.add_argument("--namespace", metavar="N", default=None, help=namespace_help)
    if store_bytes:
        parser.add_argument(
            "--store-bytes", metavar="N", type=int, default=None, help="disk store capacity"
        )


@dataclass(frozen=True)
class StoreFlags:
    """The parsed store flags."""

    store_path: str | None = None
    redis_url: str | None = None
    namespace: str | None = None
    store_bytes: int | None = None

    @classmethod
    def of(cls, args: argparse.Namespace) -> StoreFlags:
        return cls(
            getattr(args, "store_path", None),
            getattr(args, "redis_url", None),
            getattr(args, "namespace", None),
            getattr(args, "store_bytes", None),
        )


def open_store(
    flags: StoreFlags,
    *,
    ram_front: bool = False,
    require_redis: bool = False,
    block_when_full: bool = False,
    existing: bool = False,
    ram_bytes: int | None = None,
) -> KVStore:
    """The store the flags name: the Redis tier when ``redis_url`` is set, else the disk tier
    at ``store_path`` (default ``$RAGBLEND_HOME/kv``).

    ``ram_front``: a RAM tier in front (a server; an unreachable Redis is then a warning,
    its lookups misses until it is back). ``require_redis``: an unreachable Redis is an error
    (a warmup). ``block_when_full``: Redis writes wait instead of dropping when the write
    queue is full. ``existing``: the disk store must already exist (inspection; never
    evicts). ``ram_bytes``: the RAM tier's capacity (default: ``MemoryStore``'s).
    """
    from ragblend.store.disk import DEFAULT_DISK_BYTES, DiskStore, default_store_path
    from ragblend.store.memory import MemoryStore

    if ram_bytes is not None and ram_bytes < 1:
        raise RagblendError(f"the RAM tier needs a capacity >= 1 byte, got {ram_bytes}")

    def ram() -> MemoryStore:
        return MemoryStore() if ram_bytes is None else MemoryStore(ram_bytes)

    if flags.redis_url:
        from ragblend.store.layered import LayeredStore
        from ragblend.store.redis import RedisStore

        redis = RedisStore(
            flags.redis_url, namespace=flags.namespace, block_when_full=block_when_full
        )
        if (require_redis or ram_front) and not redis.ping():
            if require_redis:
                raise RagblendError(f"cannot reach Redis at {redis.url}: {redis.last_error}")
            log.warning("the Redis tier is unreachable now: lookups are misses until it is back")
        return LayeredStore([ram(), redis]) if ram_front else redis
    root = Path(flags.store_path) if flags.store_path else default_store_path()
    if existing and not (root / "index").is_dir():
        raise RagblendError(f"no KV store at {root}")
    capacity = 2**62 if existing else (flags.store_bytes or DEFAULT_DISK_BYTES)
    disk = DiskStore(root, capacity)
    if ram_front:
        from ragblend.store.tiered import TieredStore

        return TieredStore(ram(), disk)
    return disk
