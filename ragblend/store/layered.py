"""A read-through chain of tiers, fastest first: e.g. RAM → local disk → shared Redis.

``get`` asks each tier in turn; a hit below the first tier is handed out as a ``PromotedKV``
that reads layers from the tier that had it and, once every layer has been read (and verified),
puts the entry into every tier above, so the next lookup is served closer. ``put`` writes every
tier (the Redis tier's writes are asynchronous, so the query path never waits on the network).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from ragblend.store.base import ChunkKV, KVEntry, KVStore, StoreStats
from ragblend.store.quant import decode_layer
from ragblend.store.redis import RedisEntry

log = logging.getLogger(__name__)


class StoredKV:
    """An entry held as its stored layers (e.g. int8 + scales) and meta, decoded on ``layer``."""

    def __init__(self, meta: dict, layers: list[dict[str, torch.Tensor]], num_tokens: int):
        self.meta = meta
        self._layers = layers
        self._tokens = num_tokens

    @property
    def num_tokens(self) -> int:
        return self._tokens

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in self._layers for t in d.values())

    def stored_layer(self, index: int) -> dict[str, torch.Tensor]:
        return self._layers[index]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_layer(self.meta, self._layers[index])

    def materialize(self) -> ChunkKV:
        layers = [self.layer(i) for i in range(self.num_layers)]
        return ChunkKV(
            torch.stack([k for k, _ in layers]),
            torch.stack([v for _, v in layers]),
            dict(self.meta),
        )

    # tiers written before the storage-dtype seam read ``k``/``v`` (compute dtype)
    @property
    def k(self) -> torch.Tensor:
        return self.materialize().k

    @property
    def v(self) -> torch.Tensor:
        return self.materialize().v


class PromotedKV:
    """A lower tier's entry, read through; promoted to the tiers above once fully read."""

    def __init__(self, key: str, entry: KVEntry, above: Sequence[KVStore]) -> None:
        self.key = key
        self._entry = entry
        self._above = list(above)
        self.meta = entry.meta
        self._keeps_stored = isinstance(entry, (RedisEntry, StoredKV, ChunkKV))
        # layers read so far: as stored (``_keeps_stored``) or in the compute dtype
        self._stored: dict[int, dict[str, torch.Tensor]] = {}
        self._computed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
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

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._entry.layer(index)  # CorruptEntryError propagates: the engine recomputes
        with self._lock:
            if self._keeps_stored:
                self._stored[index] = self._entry.stored_layer(index)
            else:
                self._computed[index] = kv
            read = len(self._stored) + len(self._computed)
            if read == self.num_layers and not self._promoted:
                self._promoted = True
                self._promote()
        return kv

    def _promote(self) -> None:
        order = range(self.num_layers)
        if self._keeps_stored:
            full: KVEntry = StoredKV(
                dict(self.meta), [self._stored[i] for i in order], self.num_tokens
            )
        else:  # a tier without stored layers: keep the compute-dtype layers
            k = torch.stack([self._computed[i][0] for i in order])
            v = torch.stack([self._computed[i][1] for i in order])
            full = ChunkKV(k, v, {**self.meta, "kv_dtype": str(k.dtype).removeprefix("torch.")})
        for tier in self._above:
            tier.put(self.key, full)

    def stored_layer(self, index: int) -> dict[str, torch.Tensor]:
        return self._entry.stored_layer(index)

    def materialize(self) -> ChunkKV:
        for i in range(self.num_layers):
            self.layer(i)
        return self._entry.materialize()


class LayeredStore:
    """Tiers fastest first (e.g. ``[MemoryStore, DiskStore, RedisStore]``), read-through."""

    def __init__(self, tiers: Sequence[KVStore]) -> None:
        if not tiers:
            raise ValueError("a layered store needs at least one tier")
        self.tiers = list(tiers)
        self.tier = "+".join(t.tier for t in self.tiers)
        self.prefetch_depth = max(t.prefetch_depth for t in self.tiers)
        self.stats = StoreStats()

    def __contains__(self, key: str) -> bool:
        return any(key in t for t in self.tiers)

    def get(self, key: str) -> KVEntry | None:
        for depth, tier in enumerate(self.tiers):
            entry = tier.get(key)
            if entry is not None:
                self.stats.count("hits")
                return entry if depth == 0 else PromotedKV(key, entry, self.tiers[:depth])
        self.stats.count("misses")
        return None

    def put(self, key: str, kv: KVEntry) -> None:
        for tier in self.tiers:
            tier.put(key, kv)
        self.stats.count("puts")

    def discard(self, key: str) -> None:
        for tier in self.tiers:
            tier.discard(key)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()

    def __repr__(self) -> str:
        return f"LayeredStore({self.tiers!r})"
