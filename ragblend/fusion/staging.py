"""Host staging for the layer loader: every cached segment of a layer → one host buffer → the
compute device in one copy per tensor (K, V), with an event per layer instead of a global wait.

The same code runs on both devices; only the copy engine differs (:class:`HostCopies`,
:class:`CudaCopies`):

- CUDA: host buffers are pinned, the copy to the device runs on a side stream and records an
  event; the consumer's stream waits on that event (no host synchronisation) and the layer's
  tensors are marked as used by it (``record_stream``), so the caching allocator never recycles
  them early. Before refilling a host buffer, the reader waits for the event of the copy that
  last read it (only that copy, never the whole device).
- CPU: plain host buffers, synchronous copies, events that are complete when recorded. CUDA
  needs staging; a CPU does not (it is one copy more than reading the tier into the layer
  directly), so the CPU takes it only when asked (``LayerLoader(staging=True)``): that is how
  CPU tests cover the ring, its events and the reader thread that the CUDA path runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Protocol

import torch

from ragblend.store.base import ChunkKV, KVEntry

if TYPE_CHECKING:
    from ragblend.fusion.layer_loader import LayerLoader


class CopyEvent(Protocol):
    """What the loader needs of an event: waiting on the host until its copies are done."""

    def synchronize(self) -> None: ...


class _Complete:
    """The event of copies that have already happened (CPU copies are synchronous)."""

    def synchronize(self) -> None:
        return None


COMPLETE = _Complete()


class HostCopies:
    """The CPU's copy engine: copies run when issued, so every event is already complete."""

    pin = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def enter_thread(self) -> None:
        return None

    def stream(self) -> AbstractContextManager:
        return nullcontext()

    def record(self) -> CopyEvent:
        return COMPLETE

    def hand_over(self, event: CopyEvent, tensors: Sequence[torch.Tensor]) -> None:
        event.synchronize()


class CudaCopies:
    """CUDA's copy engine: a side stream, an event per batch of copies, stream-ordered hand-over."""

    pin = True

    def __init__(self, device: torch.device) -> None:
        index = device.index
        self.device = torch.device("cuda", torch.cuda.current_device() if index is None else index)
        consumer = torch.cuda.current_stream(self.device)
        self.side = torch.cuda.Stream(device=self.device)
        # cached segments produced on the consumer's stream must be complete before we read them
        self.side.wait_stream(consumer)

    def enter_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def stream(self) -> AbstractContextManager:
        return torch.cuda.stream(self.side)

    def record(self) -> CopyEvent:
        event = torch.cuda.Event()
        event.record(self.side)
        return event

    def hand_over(self, event: CopyEvent, tensors: Sequence[torch.Tensor]) -> None:
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)  # type: ignore[arg-type]  # a torch.cuda.Event here
        for t in tensors:
            t.record_stream(stream)


Copies = HostCopies | CudaCopies


def copies_for(device: torch.device) -> Copies:
    """The copy engine of ``device``."""
    return CudaCopies(device) if device.type == "cuda" else HostCopies(device)


class Stager:
    """Loads one layer of every segment through a ring of host buffers.

    The ring has ``loader.prefetch + 1`` slots (one per layer the reader may hold ahead, plus
    the one being filled); each slot is a K and a V buffer [1, Hkv, N, d] in the compute dtype,
    pinned on CUDA. Segments already resident on the compute device (a device tier) skip the
    ring and are copied on the device, all of them by one ``cat`` per tensor when nothing
    else is in the layer.
    """

    def __init__(self, loader: LayerLoader, copies: Copies) -> None:
        self.loader = loader
        self.copies = copies
        heads, dim = loader.shape
        self.resident = [_resident(c, loader.device) for c in loader.caches]
        self.host_segments = any(
            c is not None and not r for c, r in zip(loader.caches, self.resident, strict=True)
        )
        self.ring: list[tuple[torch.Tensor, torch.Tensor, CopyEvent | None]] = []
        if self.host_segments:
            shape = (1, heads, loader.total, dim)
            for _ in range(loader.prefetch + 1):
                hk = torch.empty(shape, dtype=loader.dtype, pin_memory=copies.pin)
                hv = torch.empty(shape, dtype=loader.dtype, pin_memory=copies.pin)
                self.ring.append((hk, hv, None))
        self.layers_staged = 0

    def enter_thread(self) -> None:
        """Call first on the reader thread."""
        self.copies.enter_thread()

    def load(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, CopyEvent]:
        """Layer ``layer``'s K and V on the compute device (new tensors) and the event after
        which they hold it; hand them to the consumer with :meth:`consume`."""
        lo = self.loader
        lo.fetch_batched(layer)
        heads, dim = lo.shape
        with self.copies.stream():
            k = torch.empty(1, heads, lo.total, dim, device=lo.device, dtype=lo.dtype)
            v = torch.empty_like(k)
            if self.host_segments:
                self._through_ring(layer, k, v)
            else:  # every cached segment is on the device: gather them there
                lo.gather(layer, k, v)
            ready = self.copies.record()
        self.layers_staged += 1
        return k, v, ready

    def _through_ring(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        lo = self.loader
        slot = layer % len(self.ring)
        hk, hv, done = self.ring[slot]
        if done is not None:
            done.synchronize()  # the previous copy out of this host buffer has finished
        device_parts = []
        start = 0
        for cache, n, resident in zip(lo.caches, lo.lengths, self.resident, strict=True):
            if cache is None:
                hk[0, :, start : start + n].zero_()
                hv[0, :, start : start + n].zero_()
            else:
                ck, cv = cache.layer(layer)  # disk → RAM happens here, on the reader's thread
                if resident:
                    device_parts.append((start, n, ck, cv))
                else:
                    hk[0, :, start : start + n].copy_(ck)
                    hv[0, :, start : start + n].copy_(cv)
            start += n
        k.copy_(hk, non_blocking=True)
        v.copy_(hv, non_blocking=True)
        self.ring[slot] = (hk, hv, self.copies.record())
        for start, n, ck, cv in device_parts:  # a tier mix: device-resident rows on the device
            k[0, :, start : start + n].copy_(ck, non_blocking=True)
            v[0, :, start : start + n].copy_(cv, non_blocking=True)

    def consume(self, k: torch.Tensor, v: torch.Tensor, ready: CopyEvent) -> None:
        """Make the consumer's stream wait for ``ready`` and own ``k`` and ``v``."""
        self.copies.hand_over(ready, (k, v))


def _resident(cache: KVEntry | None, device: torch.device) -> bool:
    """Whether a cache entry's tensors already live on the (non-CPU) compute device: RAM-tier
    entries may, when the KV was put there on the device."""
    if device.type == "cpu" or not isinstance(cache, ChunkKV):
        return False
    return cache.k.device.type == device.type
