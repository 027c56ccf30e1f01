"""KV store: content keys, chunk KV entries and storage tiers."""

from __future__ import annotations

import os
from typing import Literal

from ragblend.store.base import ChunkKV, KVEntry, KVStore, StoreStats
from ragblend.store.disk import DEFAULT_DISK_BYTES, DiskChunkKV, DiskStore
from ragblend.store.keys import chunk_key, model_fingerprint
from ragblend.store.memory import MemoryStore
from ragblend.store.quant import QuantizedKV, pack
from ragblend.store.tiered import PromotingKV, TieredStore

__all__ = [
    "ChunkKV",
    "DiskChunkKV",
    "DiskStore",
    "KVEntry",
    "KVStore",
    "MemoryStore",
    "PromotingKV",
    "QuantizedKV",
    "StoreStats",
    "TieredStore",
    "chunk_key",
    "make_store",
    "model_fingerprint",
    "pack",
]


def make_store(
    tier: Literal["ram", "disk", "tiered", "redis"] = "ram",
    path: str | os.PathLike | None = None,
    ram_bytes: int = 4 << 30,
    disk_bytes: int = DEFAULT_DISK_BYTES,
    fsync: bool = True,
    url: str | None = None,
    namespace: str | None = None,
) -> KVStore:
    """A KV store of the given tier; ``path`` defaults to ``ragblend_home()/kv``.

    ``"redis"``: the shared tier at ``url`` (``redis://``, ``rediss://``, ``unix://``), keys
    under ``namespace`` (see ``ragblend.store.redis``).
    """
    from ragblend.errors import RagblendError

    if tier == "ram":
        return MemoryStore(ram_bytes)
    if tier == "disk":
        return DiskStore(path, disk_bytes, fsync=fsync)
    if tier == "tiered":
        return TieredStore(MemoryStore(ram_bytes), DiskStore(path, disk_bytes, fsync=fsync))
    if tier == "redis":
        from ragblend.store.redis import RedisStore

        return RedisStore(url or "redis://127.0.0.1:6379/0", namespace=namespace)
    raise RagblendError(f"unknown store tier {tier!r}; expected ram, disk, tiered or redis")
