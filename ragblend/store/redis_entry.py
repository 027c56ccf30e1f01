"""One Redis hash per chunk entry: its fields' encoding and the entry as the tier hands it out.

Fields: ``header`` (JSON: format version, key, the entry's meta, layer count, token count,
bytes, per-layer xxh3 checksums) and ``L{i}`` (layer i's stored tensors as safetensors bytes).
``RedisEntry`` keeps the layers fetched so far (``RedisStore.fetch_layers`` fills them for many
entries in one round trip), verified against the header's checksums.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Protocol

import torch
import xxhash
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ragblend.errors import CorruptEntryError
from ragblend.store.base import ChunkKV, KVEntry, LayerBatcher
from ragblend.store.quant import decode_layer


class EntryServer(LayerBatcher, Protocol):
    """What an entry needs of its store (:class:`~ragblend.store.redis.RedisStore`): layer
    reads batched over entries, how many layers one read fetches, and dropping a bad entry."""

    layers_per_fetch: int

    def drop(self, key: str, reason: str | None = None) -> None: ...


FORMAT_VERSION = 1
HEADER = "header"
CHECKSUM = "xxh3_64"


def layer_field(index: int) -> str:
    return f"L{index}"


def encode_layer(tensors: dict[str, torch.Tensor]) -> bytes:
    """One layer's stored tensors as safetensors bytes."""
    return st_save({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()})


def checksum(blob: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(blob)


def encode_entry(key: str, kv: KVEntry) -> dict[str, bytes]:
    """The hash fields of one entry: ``header`` and ``L{i}`` for every layer."""
    fields, sums = {}, []
    for i in range(kv.num_layers):
        blob = encode_layer(kv.stored_layer(i))
        fields[layer_field(i)] = blob
        sums.append(checksum(blob))
    header = {
        "format": FORMAT_VERSION,
        "key": key,
        "meta": kv.meta,
        "layers": kv.num_layers,
        "tokens": kv.num_tokens,
        "nbytes": kv.nbytes,
        "checksum": CHECKSUM,
        "sums": sums,
        "created": time.time(),
    }
    fields[HEADER] = json.dumps(header, default=str).encode()
    return fields


class RedisEntry:
    """One entry in Redis, read layer by layer (each layer verified against the header)."""

    def __init__(self, store: EntryServer, key: str, header: dict) -> None:
        self._store = store
        self.key = key
        self.header = header
        self.meta: dict = dict(header["meta"])
        self._stored: dict[int, dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        return int(self.header["tokens"])

    @property
    def num_layers(self) -> int:
        return int(self.header["layers"])

    @property
    def nbytes(self) -> int:
        return int(self.header["nbytes"])

    def stored_layer(self, index: int) -> dict[str, torch.Tensor]:
        """Layer ``index`` as stored (e.g. int8 + scales); one round trip unless already
        fetched (``RedisStore.fetch_layers`` reads it together with other entries')."""
        with self._lock:
            stored = self._stored.get(index)
        if stored is None:
            self._store.fetch_layers([self], index)
            with self._lock:
                stored = self._stored[index]
        return stored

    def layer_batcher(self) -> tuple[EntryServer, RedisEntry]:
        return self._store, self

    def _wanted(self, index: int) -> list[int]:
        """Layers to fetch for ``index``: none when it is here, else it and up to
        ``layers_per_fetch - 1`` after it (less those already here)."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} of {self.num_layers}")
        ahead = range(index, min(index + self._store.layers_per_fetch, self.num_layers))
        with self._lock:
            if index in self._stored:
                return []
            return [i for i in ahead if i not in self._stored]

    def _accept(self, wanted: list[int], blobs: list[bytes | None]) -> None:
        """Verify and parse fetched layers; ``CorruptEntryError`` (the entry dropped if its
        data is bad) at the first that fails."""
        for i, blob in zip(wanted, blobs, strict=True):
            if blob is None:
                raise CorruptEntryError(self.key, f"layer {i} is gone (evicted or deleted)")
            if checksum(blob) != self.header["sums"][i]:
                self._store.drop(self.key, f"layer {i} fails its checksum")
                raise CorruptEntryError(self.key, f"layer {i} fails its checksum")
            try:
                tensors = st_load(blob)
            except Exception as exc:  # safetensors raises its own error types
                self._store.drop(self.key, f"layer {i} is unreadable: {exc}")
                raise CorruptEntryError(self.key, f"layer {i} is unreadable") from None
            with self._lock:
                self._stored[i] = tensors

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute-dtype K and V of one layer, [kv_heads, tokens, head_dim]."""
        return decode_layer(self.meta, self.stored_layer(index), index)

    def materialize(self) -> ChunkKV:
        layers = [self.layer(i) for i in range(self.num_layers)]
        k = torch.stack([kv[0] for kv in layers])
        v = torch.stack([kv[1] for kv in layers])
        return ChunkKV(k, v, dict(self.meta))
