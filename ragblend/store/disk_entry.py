"""A disk tier's entry as handed out: one open entry file, read layer by layer on demand."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from ragblend.errors import CorruptEntryError
from ragblend.store import codec
from ragblend.store.base import ChunkKV
from ragblend.store.codec import EntryHeader, EntryInvalid
from ragblend.store.quant import decode_layer, from_stored


class DiskChunkKV:
    """A disk entry (a ``KVEntry``); each layer is read, verified and decoded on demand.

    The file stays open while the object lives, so an entry evicted meanwhile still reads.
    """

    def __init__(
        self,
        key: str,
        path: Path,
        fd: int,
        header: EntryHeader,
        on_corrupt: Callable[[str], None] | None = None,
    ) -> None:
        self._on_corrupt = on_corrupt
        self.key = key
        self.path = path
        self._fd = fd
        self.header = header
        self._full: ChunkKV | None = None
        self.meta = {**header.entry_meta(), "tier": "disk"}

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens

    @property
    def num_layers(self) -> int:
        return self.header.num_layers

    @property
    def nbytes(self) -> int:
        return self.header.data_bytes

    def read_stored_into(self, index: int, out: dict[str, torch.Tensor]) -> None:
        """Read layer ``index``'s stored tensors into ``out`` (see ``codec.empty_layer``);
        ``CorruptEntryError`` when it does not verify (after ``on_corrupt(reason)``, with which
        the tier drops the entry)."""
        try:
            codec.read_layer_into(self._fd, self.header, index, out)
        except EntryInvalid as exc:
            if self._on_corrupt is not None:
                self._on_corrupt(str(exc))
            raise CorruptEntryError(self.key, str(exc)) from None

    def stored_layer(self, index: int) -> dict[str, torch.Tensor]:
        out = codec.empty_layer(self.header)
        self.read_stored_into(index, out)
        return out

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer in the compute dtype, [kv_heads, tokens, head_dim]."""
        if self._full is not None:
            return self._full.layer(index)
        return decode_layer(self.meta, self.stored_layer(index), index)

    def materialize(self) -> ChunkKV:
        """Every layer read, verified and decoded into one ChunkKV (cached on this object)."""
        if self._full is None:
            stacked = codec.empty_layer(self.header, self.num_layers)
            for i in range(self.num_layers):
                self.read_stored_into(i, {n: t[i] for n, t in stacked.items()})
            self._full = from_stored(dict(self.meta), stacked).materialize()
        return self._full

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()
