"""The store interface and the chunk KV entry every tier holds."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class ChunkKV:
    """Pre-RoPE K and V of one chunk for every layer: tensors [layers, kv_heads, tokens, head_dim].

    ``meta`` records what the entry was computed with (fingerprint, dtype, context) so a tier
    can refuse foreign entries.
    """

    k: torch.Tensor
    v: torch.Tensor
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.k.shape[2])

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, [kv_heads, tokens, head_dim] (views: do not modify)."""
        return self.k[index], self.v[index]


@dataclass
class StoreStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, name: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "puts": self.puts,
            "evictions": self.evictions,
        }


@runtime_checkable
class KVStore(Protocol):
    """What the engine needs from a KV store; tiers (RAM, disk, tiered) implement it."""

    stats: StoreStats

    def get(self, key: str) -> ChunkKV | None:
        """The entry, or None on a miss (never a partial or foreign entry)."""

    def put(self, key: str, kv: ChunkKV) -> None:
        """Store an entry (may evict others)."""

    def __contains__(self, key: str) -> bool: ...
