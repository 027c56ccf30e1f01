"""Layer-wise KV loading for the fusor: yields each layer's cached K/V for the whole prompt.

The loader concatenates, per layer, the cached pre-RoPE K and V of every segment (zeros where a
segment has no cache) into fresh tensors on the compute device, so the fusor may scatter into
them without touching the store's copies.

With ``prefetch > 0`` a reader thread loads up to ``prefetch`` layers ahead while the fusor
computes the current one (paper §5 pipelining): on CPU it reads the tier (disk → RAM) into the
layer tensors; on CUDA it additionally stages host data in pinned buffers and copies them to
the device on a side stream, recording one event per layer that the consumer's stream waits on
(no global synchronize). A reader exception (e.g. a corrupt disk entry) is re-raised in the
consumer at the layer where it happened.

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

from ragblend.store.base import BatchableEntry, ChunkKV, KVEntry, LayerBatcher
from ragblend.threads import copy_only_thread


class LayerLoader:
    """Iterates (layer, k_pre [1, Hkv, N, d], v [1, Hkv, N, d]) for a list of segments.

    After iteration, ``wait_s`` is how long the consumer waited for layers (the loading delay
    the pipeline did not hide) and ``max_ahead`` the most layers loaded but not yet consumed.
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
    ) -> None:
        self.caches = list(caches)
        self.lengths = list(lengths)
        self.num_layers = num_layers
        self.shape = (kv_heads, head_dim)
        self.device = torch.device(device)
        self.dtype = dtype
        self.prefetch = max(0, int(prefetch))
        self.wait_s = 0.0
        self.max_ahead = 0
        self._produced = 0
        self._consumed = 0
        self._count_lock = threading.Lock()
        self.batches = batch_groups(self.caches)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def load(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cached K and V for the whole prompt (new tensors, current stream)."""
        self.fetch_batched(layer)
        heads, dim = self.shape
        k = torch.empty(1, heads, self.total, dim, device=self.device, dtype=self.dtype)
        v = torch.empty_like(k)
        start = 0
        for cache, n in zip(self.caches, self.lengths, strict=True):
            if cache is None:
                k[0, :, start : start + n].zero_()
                v[0, :, start : start + n].zero_()
            else:
                ck, cv = cache.layer(layer)
                k[0, :, start : start + n].copy_(ck, non_blocking=True)
                v[0, :, start : start + n].copy_(cv, non_blocking=True)
            start += n
        return k, v

    def fetch_batched(self, layer: int) -> None:
        """Fetch ``layer`` of every batchable entry: one call (round trip) per tier."""
        for batcher, entries in self.batches:
            batcher.fetch_layers(entries, layer)

    def __iter__(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        if self.prefetch <= 0 or self.num_layers == 0:
            for layer in range(self.num_layers):
                t0 = time.perf_counter()
                k, v = self.load(layer)
                self.wait_s += time.perf_counter() - t0
                yield layer, k, v
            return
        if self.device.type == "cuda" and torch.cuda.is_available():
            yield from self._prefetched(_CudaStager(self))
        else:
            yield from self._prefetched(None)

    # ------------------------------------------------------------------ reader thread
    def _prefetched(
        self, stager: _CudaStager | None
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        slots: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def reader() -> None:
            try:
                copy_only_thread()  # no OpenMP team of its own (see ragblend.threads)
                if stager is not None:
                    stager.enter_thread()
                for layer in range(self.num_layers):
                    if stop.is_set():
                        return
                    item = stager.load(layer) if stager is not None else (*self.load(layer), None)
                    with self._count_lock:
                        self._produced += 1
                        self.max_ahead = max(self.max_ahead, self._produced - self._consumed)
                    slots.put((layer, *item))
            except BaseException as exc:  # propagated to the consumer
                slots.put(exc)

        thread = threading.Thread(target=reader, name="ragblend-layer-loader", daemon=True)
        thread.start()
        try:
            for _ in range(self.num_layers):
                t0 = time.perf_counter()
                item = slots.get()
                if isinstance(item, BaseException):
                    raise item
                layer, k, v, ready = item
                if ready is not None:  # only the CUDA stager hands out events
                    assert stager is not None
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


class _CudaStager:
    """CUDA path of the reader: host segments → pinned buffer → device on a side stream.

    Each layer gets its own device tensors, allocated on the side stream, and an event recorded
    after its copies; the consumer's stream waits on that event and the tensors are marked as
    used by it (``record_stream``), so the caching allocator never recycles them early. Pinned
    buffers are reused round-robin; before refilling one, the reader waits for the event of the
    copy that last read it (only that copy, never the whole device).
    """

    def __init__(self, loader: LayerLoader) -> None:
        self.loader = loader
        index = loader.device.index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        self.consumer_stream = torch.cuda.current_stream(self.device)
        self.side = torch.cuda.Stream(device=self.device)
        # Cached segments produced on the consumer's stream must be complete before we read them.
        self.side.wait_stream(self.consumer_stream)
        heads, dim = loader.shape
        self.host_segments = any(c is not None and not _on_cuda(c) for c in loader.caches)
        self.ring: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = []
        if self.host_segments:
            for _ in range(loader.prefetch + 1):
                shape = (1, heads, loader.total, dim)
                hk = torch.empty(shape, dtype=loader.dtype, pin_memory=True)
                hv = torch.empty(shape, dtype=loader.dtype, pin_memory=True)
                self.ring.append((hk, hv, None))

    def enter_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def load(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
        lo = self.loader
        lo.fetch_batched(layer)
        heads, dim = lo.shape
        with torch.cuda.stream(self.side):
            k = torch.empty(1, heads, lo.total, dim, device=self.device, dtype=lo.dtype)
            v = torch.empty_like(k)
            device_parts = []
            if self.host_segments:
                slot = layer % len(self.ring)
                hk, hv, done = self.ring[slot]
                if done is not None:
                    done.synchronize()  # the previous copy out of this pinned buffer finished
                start = 0
                for cache, n in zip(lo.caches, lo.lengths, strict=True):
                    if cache is None:
                        hk[0, :, start : start + n].zero_()
                        hv[0, :, start : start + n].zero_()
                    else:
                        ck, cv = cache.layer(layer)  # disk → RAM happens here, on this thread
                        if ck.is_cuda:
                            device_parts.append((start, n, ck, cv))
                        else:
                            hk[0, :, start : start + n].copy_(ck)
                            hv[0, :, start : start + n].copy_(cv)
                    start += n
                k.copy_(hk, non_blocking=True)
                v.copy_(hv, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self.side)
                self.ring[slot] = (hk, hv, done)
            else:
                start = 0
                for cache, n in zip(lo.caches, lo.lengths, strict=True):
                    if cache is None:
                        k[0, :, start : start + n].zero_()
                        v[0, :, start : start + n].zero_()
                    else:
                        ck, cv = cache.layer(layer)
                        device_parts.append((start, n, ck, cv))
                    start += n
            for start, n, ck, cv in device_parts:  # device-resident caches: copy on the device
                k[0, :, start : start + n].copy_(ck, non_blocking=True)
                v[0, :, start : start + n].copy_(cv, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.side)
        return k, v, ready

    def consume(self, k: torch.Tensor, v: torch.Tensor, ready: torch.cuda.Event) -> None:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(ready)
        k.record_stream(stream)
        v.record_stream(stream)


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


def _on_cuda(cache) -> bool:
    """Whether a cache entry's tensors already live on a CUDA device (RAM-tier entries may)."""
    k = getattr(cache, "k", None) if isinstance(cache, ChunkKV) else None
    return bool(k is not None and k.is_cuda)
