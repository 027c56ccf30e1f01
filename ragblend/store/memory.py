"""RAM tier: a byte-bounded LRU of chunk KV entries."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ragblend.store.base import KVEntry, StoreStats
from ragblend.store.quant import in_memory


class MemoryStore:
    """Thread-safe LRU keyed by chunk key, bounded by ``capacity_bytes`` of stored tensors.

    Holds entries as stored (a quantised entry stays quantised); ``prefetch_depth`` turns 2 once
    an entry needs decoding (another storage than compute dtype), so the layer loader decodes
    on its reader thread (where a core is free for it) instead of inside the fusion loop.
    """

    tier = "ram"

    def __init__(self, capacity_bytes: int = 4 << 30) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.stats = StoreStats()
        self.prefetch_depth = 0
        self._entries: OrderedDict[str, KVEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def get(self, key: str) -> KVEntry | None:
        with self._lock:
            kv = self._entries.get(key)
            if kv is not None:
                self._entries.move_to_end(key)
        self.stats.count("hits" if kv is not None else "misses")
        return kv

    def put(self, key: str, kv: KVEntry) -> None:
        if kv.nbytes > self.capacity_bytes:
            return
        held = in_memory(kv)
        stored, compute = held.meta.get("kv_dtype"), held.meta.get("compute_dtype")
        if stored and compute and stored != compute:
            self.prefetch_depth = 2
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = held
            self._bytes += held.nbytes
            while self._bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self.stats.count("evictions")
        self.stats.count("puts")

    def discard(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes

    def drop_page_cache(self) -> bool:
        """Nothing of this tier is in files."""
        return False

    def close(self) -> None:
        self.clear()

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
