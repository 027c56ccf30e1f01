"""A read-through chain of tiers, fastest first: e.g. RAM → local disk → shared Redis.

``get`` asks each tier in turn; a hit below the first tier is handed out as a ``PromotedKV``
that reads each layer's stored tensors once from the tier that had it and, once every layer has
been read (and verified), puts the entry, as stored, into every tier above, so the next lookup
is served closer. ``put`` writes every tier (the Redis tier's writes are asynchronous, so the
query path never waits on the network). ``TieredStore`` (RAM → disk) is this chain of two.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from ragblend.store.base import BatchableEntry, ChunkKV, KVEntry, KVStore, LayerBatcher, StoreStats
from ragblend.store.disk_entry import DiskChunkKV
from ragblend.store.quant import decode_layer, from_stored


class PromotedKV:
    """A lower tier's entry, read through layer by layer; promoted to the tiers above once
    every layer has been read.

    Each layer's stored tensors (e.g. int8 + scales) are read from the lower entry once and
    kept; ``layer(i)`` decodes them to the compute dtype. A ``CorruptEntryError`` from the lower
    tier propagates (the engine discards the entry and recomputes); nothing is promoted then.
    """

    def __init__(
        self, key: str, entry: KVEntry, above: Sequence[KVStore], source_tier: str = ""
    ) -> None:
        self.key = key
        self.source_tier = source_tier  # the name of the tier that held the entry
        self._entry = entry
        self._above = list(above)
        self.meta = entry.meta
        self._stored: dict[int, dict[str, torch.Tensor]] = {}
        self._promoted = False
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

    def layer_batcher(self) -> tuple[LayerBatcher, KVEntry] | None:
        """The lower entry's batcher, if it has one (reads land in the lower entry, where
        ``stored_layer`` picks them up)."""
        if isinstance(self._entry, BatchableEntry):
            return self._entry.layer_batcher()
        return None

    def stored_layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer ``index`` as stored (read from the lower tier once; do not modify)."""
        with self._lock:
            stored = self._stored.get(index)
        if stored is not None:
            return stored
        stored = self._entry.stored_layer(index)
        with self._lock:
            stored = self._stored.setdefault(index, stored)
            complete = len(self._stored) == self.num_layers and not self._promoted
            self._promoted = self._promoted or complete
        if complete:
            self._promote()
        return stored

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer in the compute dtype, [kv_heads, tokens, head_dim]."""
        return decode_layer(self.meta, self.stored_layer(index), index)

    def _promote(self) -> None:
        layers = [self._stored[i] for i in range(self.num_layers)]
        stacked = {name: torch.stack([layer[name] for layer in layers]) for name in layers[0]}
        full = from_stored(dict(self.meta), stacked)
        for tier in self._above:
            tier.put(self.key, full)
        if isinstance(self._entry, DiskChunkKV):
            self._entry.close()  # every layer is here now: release the entry file

    def materialize(self) -> ChunkKV:
        layers = [self.layer(i) for i in range(self.num_layers)]
        k = torch.stack([k for k, _ in layers])
        v = torch.stack([v for _, v in layers])
        return ChunkKV(k, v, dict(self.meta))


class LayeredStore:
    """Tiers fastest first (e.g. ``[MemoryStore, DiskStore, RedisStore]``), read-through."""

    def __init__(self, tiers: Sequence[KVStore]) -> None:
        if not tiers:
            raise ValueError("a layered store needs at least one tier")
        self.tiers = list(tiers)
        self.tier = "+".join(t.tier for t in self.tiers)
        self.stats = StoreStats()

    @property
    def prefetch_depth(self) -> int:
        return max(t.prefetch_depth for t in self.tiers)

    def __contains__(self, key: str) -> bool:
        return any(key in t for t in self.tiers)

    def get(self, key: str) -> KVEntry | None:
        for depth, tier in enumerate(self.tiers):
            entry = tier.get(key)
            if entry is not None:
                self.stats.count("hits")
                if depth == 0:
                    return entry
                return PromotedKV(key, entry, self.tiers[:depth], tier.tier)
        self.stats.count("misses")
        return None

    def put(self, key: str, kv: KVEntry) -> None:
        for tier in self.tiers:
            tier.put(key, kv)
        self.stats.count("puts")

    def discard(self, key: str) -> None:
        for tier in self.tiers:
            tier.discard(key)

    def drop_page_cache(self) -> bool:
        """Drop the page cache of every tier that keeps files; True if any did."""
        dropped = [t.drop_page_cache() for t in self.tiers]
        return any(dropped)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def __repr__(self) -> str:
        return f"LayeredStore({self.tiers!r})"


def served_from(store: KVStore, entry: KVEntry) -> str:
    """The name of the tier that held ``entry`` when ``store.get`` handed it out (a layered
    store's first tier unless the entry was read through from a lower one)."""
    if isinstance(entry, PromotedKV) and entry.source_tier:
        return entry.source_tier
    tiers = getattr(store, "tiers", None)
    return tiers[0].tier if tiers else store.tier
