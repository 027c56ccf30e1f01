"""Layer-wise KV loading for the fusor: yields each layer's cached K/V for the whole prompt.

The loader concatenates, per layer, the cached pre-RoPE K and V of every segment (zeros where a
segment has no cache) into fresh tensors on the compute device, so the fusor may scatter into
them without touching the store's copies. With ``prefetch > 0`` a reader thread prepares the
next layers while the fusor computes the current one (paper §5 pipelining).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence

import torch

from ragblend.store.base import ChunkKV


class LayerLoader:
    """Iterates (layer, k_pre [1, Hkv, N, d], v [1, Hkv, N, d]) for a list of segments."""

    def __init__(
        self,
        caches: Sequence[ChunkKV | None],
        lengths: Sequence[int],
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
        prefetch: int = 0,
    ) -> None:
        self.caches = list(caches)
        self.lengths = list(lengths)
        self.num_layers = num_layers
        self.shape = (kv_heads, head_dim)
        self.device = torch.device(device)
        self.dtype = dtype
        self.prefetch = prefetch

    def load(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cached K and V for the whole prompt (new tensors)."""
        heads, dim = self.shape
        total = sum(self.lengths)
        k = torch.empty(1, heads, total, dim, device=self.device, dtype=self.dtype)
        v = torch.empty_like(k)
        start = 0
        for cache, n in zip(self.caches, self.lengths):
            if cache is None:
                k[0, :, start : start + n].zero_()
                v[0, :, start : start + n].zero_()
            else:
                ck, cv = cache.layer(layer)
                k[0, :, start : start + n].copy_(ck, non_blocking=True)
                v[0, :, start : start + n].copy_(cv, non_blocking=True)
            start += n
        return k, v

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        if self.prefetch <= 0:
            for layer in range(self.num_layers):
                yield (layer, *self.load(layer))
            return
        yield from self._prefetched()

    def _prefetched(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        slots: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def reader() -> None:
            try:
                for layer in range(self.num_layers):
                    if stop.is_set():
                        return
                    slots.put((layer, *self.load(layer)))
            except BaseException as exc:  # propagated to the consumer
                slots.put(exc)

        thread = threading.Thread(target=reader, name="ragblend-layer-loader", daemon=True)
        thread.start()
        try:
            for _ in range(self.num_layers):
                item = slots.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    slots.get_nowait()
                except queue.Empty:
                    thread.join(timeout=0.01)
