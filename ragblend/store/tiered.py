"""Tiered store: RAM LRU in front of the disk tier (paper §5: the KV cache store).

The two-tier case of ``LayeredStore``: a disk hit is read through a ``PromotedKV`` and promoted
to RAM once every layer has been read; puts write through, held in CPU memory.
"""

from __future__ import annotations

from ragblend.store.base import KVEntry
from ragblend.store.disk import DiskStore
from ragblend.store.layered import LayeredStore, PromotedKV
from ragblend.store.memory import MemoryStore
from ragblend.store.quant import to_cpu

#: the name this read-through entry had before the disk and Redis chains shared it
PromotingKV = PromotedKV


class TieredStore(LayeredStore):
    """RAM first, then disk (a disk hit is promoted to RAM once read); puts write through."""

    def __init__(self, ram: MemoryStore, disk: DiskStore) -> None:
        super().__init__([ram, disk])
        self.ram = ram
        self.disk = disk
        self.tier = "tiered"

    @property
    def prefetch_depth(self) -> int:
        return 2  # a disk read may be in the path of any lookup

    def put(self, key: str, kv: KVEntry) -> None:
        super().put(key, to_cpu(kv))

    def close(self) -> None:
        self.disk.close()  # the RAM tier keeps its entries (callers may still read them)

    def __repr__(self) -> str:
        return f"TieredStore(ram={self.ram.capacity_bytes} B, disk={self.disk!r})"
