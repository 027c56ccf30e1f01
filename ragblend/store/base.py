"""The store interface and the chunk KV entry every tier holds."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        """K and V of one layer, [kv_heads, tokens, head_dim], in the compute dtype (views
        when stored in it: do not modify)."""
        k, v = self.k[index], self.v[index]
        compute = _FLOAT_DTYPES.get(self.meta.get("compute_dtype", ""))
        if compute is not None and compute != k.dtype:  # packed to another float dtype
            return k.to(compute), v.to(compute)
        return k, v

    def materialize(self) -> ChunkKV:
        return self

    def stored_layer(self, index: int) -> dict[str, torch.Tensor]:
        """The tensors a tier persists for one layer (see ``ragblend.store.quant``)."""
        return {"k": self.k[index], "v": self.v[index]}


@runtime_checkable
class KVEntry(Protocol):
    """One stored chunk's KV as a tier hands it out: in RAM (``ChunkKV``), on disk (read
    layer by layer), remote, or quantised. ``layer(i)`` returns tensors in the compute dtype.
    """

    @property
    def meta(self) -> dict:
        """JSON-able: ``fingerprint``, ``dtype``, ``context``, ``kv_dtype``, ``compute_dtype``."""
        ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def nbytes(self) -> int:
        """Bytes the entry occupies in its tier (scales included)."""
        ...

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-RoPE K and V of one layer, [kv_heads, tokens, head_dim]; do not modify.

        Raises ``CorruptEntryError`` when the layer fails verification.
        """
        ...

    def materialize(self) -> ChunkKV:
        """Every layer in memory, verified, in the compute dtype."""
        ...

    def stored_layer(self, index: int) -> dict[str, torch.Tensor]:
        """The tensors a tier persists for layer ``index`` (``{"k", "v"}``, plus scales for a
        quantised entry); ``ragblend.store.quant.decode_layer(meta, ...)`` reads them back."""
        ...


@runtime_checkable
class LayerBatcher(Protocol):
    """A tier that reads one layer of several of its entries in one round trip (Redis)."""

    def fetch_layers(self, entries: Sequence[KVEntry], index: int) -> None:
        """Read layer ``index`` (and possibly a few after it) of each of ``entries`` (this
        tier's own entries) together, verified and parsed, so that ``entry.layer(index)`` then
        costs no round trip. Raises ``CorruptEntryError`` naming the first entry that fails."""
        ...


@runtime_checkable
class BatchableEntry(Protocol):
    """An entry whose layers a ``LayerBatcher`` can read together with other entries'."""

    def layer_batcher(self) -> tuple[LayerBatcher, KVEntry] | None:
        """The batcher and the entry to hand it (this one, or the one it reads through), or
        None when this entry's layers need no round trip."""
        ...


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
    """Everything callers use of a KV store; each tier (RAM, disk, tiered, ...) implements it.

    A store is a cache: every failure inside it (missing, corrupt, foreign or partial entries,
    a damaged index, an unreachable server) is a miss, never an exception out of ``get``.
    """

    stats: StoreStats
    #: short name of the tier ("ram", "disk", "tiered", ...), recorded in benchmark settings
    tier: str

    @property
    def prefetch_depth(self) -> int:
        """Layers the layer loader may read ahead on a reader thread (0: entries in memory;
        the engine uses it only where a core is free for that thread)."""
        ...

    def get(self, key: str) -> KVEntry | None:
        """The entry, or None on a miss (never a partial or foreign entry)."""
        ...

    def put(self, key: str, kv: KVEntry) -> None:
        """Store an entry (may evict others); a failed write is logged, never raised."""
        ...

    def discard(self, key: str) -> None:
        """Drop an entry (e.g. one that failed verification while being read)."""
        ...

    def __contains__(self, key: str) -> bool: ...

    def close(self) -> None: ...

    def drop_page_cache(self) -> bool:
        """Ask the OS to forget the tier's files (cold reads); False where that is impossible
        or the tier keeps nothing in files (RAM)."""
        ...
