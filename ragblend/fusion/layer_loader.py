"""Layer-wise KV loading for the fusor: yields each layer's cached K/V for the whole prompt.

The loader concatenates, per layer, the cached pre-RoPE K and V of every segment (zeros where a
segment has no cache) into fresh tensors on the compute device, so the fusor may scatter into
them without touching the store's copies.

With ``prefetch > 0`` a reader thread loads up to ``prefetch`` layers ahead while the fusor
computes the current one (paper §5 pipelining); on CPU it reads the tier (disk → RAM) into the
layer tensors. On CUDA every layer goes through host staging (:mod:`ragblend.fusion.staging`):
one host buffer per layer, one copy per tensor to the device on a side stream, and an event per
layer that the consumer's stream waits on (no global synchronize); ``staging=True`` runs that
same path on a CPU. The reader thread runs in the consumer's inference mode (tensors made
under ``torch.inference_mode`` can only be written in it). A reader exception (e.g. a corrupt
disk entry) is re-raised in the consumer at the layer where it happened.

Entries of a tier that can batch (``BatchableEntry``: the Redis tier) are fetched together:
before copying layer ``i`` the loader asks each such tier once for layer ``i`` of all its
entries (``LayerBatcher.fetch_layers``, one round trip), so a query costs about ``num_layers``
round trips rather than ``num_layers × chunks``; the per-entry ``layer(i)`` calls that follow
are then local.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from ragblend.fusion.staging import Stager, copies_for
from ragblend.store.base import BatchableEntry, KVEntry, LayerBatcher
from ragblend.threads import copy_only_thread


class LayerLoader:
    """Iterates (layer, k_pre [1, Hkv, N, d], v [1, Hkv, N, d]) for a list of segments.

    After iteration, ``wait_s`` is how long the consumer waited for layers (the loading delay
    the pipeline did not hide) and ``max_ahead`` the most layers loaded but not yet consumed.
    ``staging``: load through host staging even on a CPU (CUDA always stages; see above).
    """

    def __init__(
        self,
        caches: Sequence[KVEntry | None],
        lengths: Sequence[int],
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype,
        prefetch: int = 0,
        staging: bool = False,
    ) -> None:
        self.caches = list(caches)
        self.lengths = list(lengths)
        self.num_layers = num_layers
        self.shape = (kv_heads, head_dim)
        self.device = torch.device(device)
        self.dtype = dtype
        self.prefetch = max(0, int(prefetch))
        self.staging = staging or self.device.type == "cuda"
        self.wait_s = 0.0
        self.max_ahead = 0
        self._produced = 0
        self._consumed = 0
        self._count_lock = threading.Lock()
        self.batches = batch_groups(self.caches)
        self._zeros: dict[torch.device, torch.Tensor] = {}

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def load(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cached K and V for the whole prompt (new tensors, current stream)."""
        self.fetch_batched(layer)
        heads, dim = self.shape
        k = torch.empty(1, heads, self.total, dim, device=self.device, dtype=self.dtype)
        v = torch.empty_like(k)
        self.gather(layer, k, v)
        return k, v

    def gather(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Every segment's K and V of ``layer`` (zeros where a segment has no cache) into ``k``
        and ``v`` [1, Hkv, N, d]: one ``cat`` per tensor where every part is on their device
        (one kernel on a GPU, not one copy per segment), else a copy per segment."""
        parts = [
            self._zero_rows(n, k.device) if cache is None else cache.layer(layer)
            for cache, n in zip(self.caches, self.lengths, strict=True)
        ]
        if all(pk.device == k.device and pk.dtype == k.dtype for pk, _ in parts):
            torch.cat([pk for pk, _ in parts], dim=1, out=k[0])
            torch.cat([pv for _, pv in parts], dim=1, out=v[0])
            return
        start = 0
        for (pk, pv), n in zip(parts, self.lengths, strict=True):
            k[0, :, start : start + n].copy_(pk, non_blocking=True)
            v[0, :, start : start + n].copy_(pv, non_blocking=True)
            start += n

    def _zero_rows(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeros [Hkv, n, d] on ``device``, views of one tensor made once per loader."""
        zeros = self._zeros.get(device)
        if zeros is None:
            heads, dim = self.shape
            gap = max(n for c, n in zip(self.caches, self.lengths, strict=True) if c is None)
            zeros = self._zeros[device] = torch.zeros(
                heads, gap, dim, device=device, dtype=self.dtype
            )
        return zeros[:, :n], zeros[:, :n]

    def fetch_batched(self, layer: int) -> None:
        """Fetch ``layer`` of every batchable entry: one call (round trip) per tier."""
        for batcher, entries in self.batches:
            batcher.fetch_layers(entries, layer)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        stager = Stager(self, copies_for(self.device)) if self.staging else None
        if self.prefetch <= 0 or self.num_layers == 0:
            for layer in range(self.num_layers):
                t0 = time.perf_counter()
                if stager is None:
                    k, v = self.load(layer)
                else:
                    k, v, ready = stager.load(layer)
                    stager.consume(k, v, ready)
                self.wait_s += time.perf_counter() - t0
                yield layer, k, v
            return
        yield from self._prefetched(stager)

    # ------------------------------------------------------------------ reader thread
    def _prefetched(
        self, stager: Stager | None
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        slots: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        inference = torch.is_inference_mode_enabled()  # the consumer's, for the reader too

        def reader() -> None:
            try:
                copy_only_thread()  # no OpenMP team of its own (see ragblend.threads)
                if stager is not None:
                    stager.enter_thread()
                with torch.inference_mode(inference):
                    read_layers()
            except BaseException as exc:  # propagated to the consumer
                slots.put(exc)

        def read_layers() -> None:
            for layer in range(self.num_layers):
                if stop.is_set():
                    return
                item = stager.load(layer) if stager is not None else (*self.load(layer), None)
                with self._count_lock:
                    self._produced += 1
                    self.max_ahead = max(self.max_ahead, self._produced - self._consumed)
                slots.put((layer, *item))

        thread = threading.Thread(target=reader, name="ragblend-layer-loader", daemon=True)
        thread.start()
        try:
            for _ in range(self.num_layers):
                t0 = time.perf_counter()
                item = slots.get()
                if isinstance(item, BaseException):
                    raise item
                layer, k, v, ready = item
                if stager is not None:
                    stager.consume(k, v, ready)
                self.wait_s += time.perf_counter() - t0
                with self._count_lock:
                    self._consumed += 1
                yield layer, k, v
        finally:
            stop.set()
            while thread.is_alive():
                try:
                    slots.get_nowait()
                except queue.Empty:
                    thread.join(timeout=0.01)


def batch_groups(caches: Sequence[KVEntry | None]) -> list[tuple[LayerBatcher, list[KVEntry]]]:
    """The batchable entries among ``caches``, grouped by the tier that fetches them."""
    groups: dict[int, tuple[LayerBatcher, list[KVEntry]]] = {}
    for cache in caches:
        if isinstance(cache, BatchableEntry):
            found = cache.layer_batcher()
            if found is not None:
                batcher, entry = found
                groups.setdefault(id(batcher), (batcher, []))[1].append(entry)
    return list(groups.values())
