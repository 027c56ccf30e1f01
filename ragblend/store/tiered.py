"""Tiered store: RAM LRU in front of the disk tier (paper §5: the KV cache store)."""

from __future__ import annotations

import threading

import torch

from ragblend.store import codec
from ragblend.store.base import ChunkKV, KVEntry, StoreStats
from ragblend.store.disk import DiskChunkKV, DiskStore
from ragblend.store.memory import MemoryStore
from ragblend.store.quant import decode_layer, from_stored, to_cpu


class PromotingKV:
    """A disk entry read layer by layer into one buffer of its stored tensors; once every
    layer has been read (and verified) the entry, as stored, is promoted to the RAM tier, so
    the next hit is a RAM hit.

    Layers are still read lazily, so pipelined loading keeps overlapping disk reads with compute.
    """

    def __init__(self, entry: DiskChunkKV, ram: MemoryStore) -> None:
        self._entry = entry
        self._ram = ram
        self.key = entry.key
        self.meta = entry.meta
        self._stacked: dict[str, torch.Tensor] | None = None
        self._read: set[int] = set()
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        return self._entry.num_tokens

    @property
    def num_layers(self) -> int:
        return self._entry.num_layers

    @property
    def nbytes(self) -> int:
        return self._entry.nbytes

    def stored_layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer ``index`` as stored (views into the promotion buffer: do not modify)."""
        with self._lock:
            if self._stacked is None:
                self._stacked = codec.empty_layer(self._entry.header, self.num_layers)
            layer = {name: t[index] for name, t in self._stacked.items()}
            if index not in self._read:
                self._entry.read_stored_into(index, layer)
                self._read.add(index)
                if len(self._read) == self.num_layers:
                    meta = {**self.meta, "tier": "ram"}
                    self._ram.put(self.key, from_stored(meta, self._stacked))
                    self._entry.close()
            return layer

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer in the compute dtype (do not modify)."""
        return decode_layer(self.meta, self.stored_layer(index))

    def materialize(self) -> ChunkKV:
        for i in range(self.num_layers):
            self.stored_layer(i)
        assert self._stacked is not None
        return from_stored(dict(self.meta), self._stacked).materialize()


class TieredStore:
    """RAM first, then disk (a disk hit is promoted to RAM once read); puts write through."""

    tier = "tiered"
    prefetch_depth = 2

    def __init__(self, ram: MemoryStore, disk: DiskStore) -> None:
        self.ram = ram
        self.disk = disk
        self.stats = StoreStats()

    def __contains__(self, key: str) -> bool:
        return key in self.ram or key in self.disk

    def get(self, key: str) -> KVEntry | None:
        kv = self.ram.get(key)
        if kv is not None:
            self.stats.count("hits")
            return kv
        entry = self.disk.get(key)
        if entry is None:
            self.stats.count("misses")
            return None
        self.stats.count("hits")
        return PromotingKV(entry, self.ram)

    def put(self, key: str, kv: KVEntry) -> None:
        held = to_cpu(kv)
        self.ram.put(key, held)
        self.disk.put(key, held)
        self.stats.count("puts")

    def discard(self, key: str) -> None:
        self.ram.discard(key)
        self.disk.discard(key)

    def drop_page_cache(self) -> bool:
        return self.disk.drop_page_cache()

    def close(self) -> None:
        self.disk.close()

    def __repr__(self) -> str:
        return f"TieredStore(ram={self.ram.capacity_bytes} B, disk={self.disk!r})"
