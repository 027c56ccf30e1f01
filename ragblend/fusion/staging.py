"""Host staging for the layer loader: every cached segment of a layer → host buffers → the
compute device in one copy per buffer (K, V), with an event per layer instead of a global wait.

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

Compactly stored segments (int8 codes + scales, or a float storage dtype narrower than the
compute dtype, e.g. bf16 with fp32 compute) are staged as stored and widened on the compute
device after the copy (:class:`CompactLayout`), so the host buffers and the copies carry the
compact bytes; the widening is the arithmetic of ``quant.decode_layer``, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from ragblend.store.base import ChunkKV, KVEntry
from ragblend.store.quant import FLOAT_KV_DTYPES


class StagedLoad(Protocol):
    """What a :class:`Stager` stages for (a :class:`~ragblend.fusion.layer_loader.LayerLoader`):
    the segments' entries (None = computed here) and lengths, the (KV heads, head dim) shape,
    where and in what dtype the fusor reads, and how many layers it loads ahead; batched
    reads of a layer, and gathering one whose segments are all on the device already."""

    caches: list[KVEntry | None]
    lengths: list[int]
    shape: tuple[int, int]
    device: torch.device
    dtype: torch.dtype
    prefetch: int

    @property
    def total(self) -> int: ...

    def fetch_batched(self, layer: int) -> None: ...

    def gather(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None: ...


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

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

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

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

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
    the one being filled), pinned on CUDA, laid out by a :class:`CompactLayout`: a K and a V
    buffer [1, Hkv, N, d] in the compute dtype when no segment is stored compactly. Segments
    already resident on the compute device (a device tier) skip the ring and are copied on the
    device, all of them by one ``cat`` per tensor when nothing else is in the layer.
    """

    def __init__(self, loader: StagedLoad, copies: Copies) -> None:
        self.loader = loader
        self.copies = copies
        heads, dim = loader.shape
        caches = loader.caches
        self.resident = [_resident(c, loader.device) for c in caches]
        self.host_segments = any(
            c is not None and not r for c, r in zip(caches, self.resident, strict=True)
        )
        kinds = [_kind(c, r, loader.dtype) for c, r in zip(caches, self.resident, strict=True)]
        with copies.stream():  # row indices (compact segments only) are uploaded once, here
            self.layout = CompactLayout(kinds, loader.lengths, loader.device)
        self.ring: list[tuple[dict[str, torch.Tensor], CopyEvent | None]] = [
            (self.layout.buffers(heads, dim, loader.dtype, copies.pin), None)
            for _ in range(loader.prefetch + 1 if self.host_segments else 0)
        ]
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
        host, done = self.ring[slot]
        if done is not None:
            done.synchronize()  # the previous copy out of this slot's buffers has finished
        device_parts = []
        start = 0
        for i, (cache, n) in enumerate(zip(lo.caches, lo.lengths, strict=True)):
            if self.resident[i]:
                device_parts.append((start, n, *cache.layer(layer)))  # type: ignore[union-attr]
            else:  # disk → RAM happens here, on the reader's thread
                self.layout.fill(host, i, cache, layer)
            start += n
        if self.layout.direct:  # no compact segment: the buffers are the layer
            moved = {"full.k": k, "full.v": v}
        else:
            moved = {name: torch.empty_like(t, device=lo.device) for name, t in host.items()}
        for name, t in host.items():
            self.copies.copy(moved[name], t)
        self.ring[slot] = (host, self.copies.record())
        if not self.layout.direct:
            self.layout.widen(moved, k, v)
        for start, n, ck, cv in device_parts:  # a tier mix: device-resident rows on the device
            k[0, :, start : start + n].copy_(ck, non_blocking=True)
            v[0, :, start : start + n].copy_(cv, non_blocking=True)

    def consume(self, k: torch.Tensor, v: torch.Tensor, ready: CopyEvent) -> None:
        """Make the consumer's stream wait for ``ready`` and own ``k`` and ``v``."""
        self.copies.hand_over(ready, (k, v))


FULL, INT8 = "full", "int8"


class CompactLayout:
    """How a ring slot holds a layer: the prompt's rows grouped by how they are staged.

    With no compactly stored segment (``direct``) there is one group, ``"full"``, of every row.
    Otherwise each segment's rows go, in prompt order, to one group: ``"full"`` (compute-dtype
    segments and zeros), ``"int8"``, or a narrower float storage dtype's name (``"bfloat16"``,
    ...), device-resident segments to none. A ring slot holds, per group of ``n`` rows,
    ``"{group}.k"``/``"{group}.v"`` [1, Hkv, n, d] as stored (int8 codes; the storage dtype;
    the compute dtype for ``"full"``), and for int8 ``"int8.v_scale"`` [1, Hkv, n, 1] and
    ``"int8.k_scale"`` [Hkv, S, d] (float32, a column per int8 segment). :meth:`widen` spends
    a fixed number of kernels per layer, however many segments there are.
    """

    def __init__(self, kinds: list[str | None], lengths: list[int], device: torch.device) -> None:
        #: no compact segment: one "full" group of every row, copied as it is into the layer
        self.direct = all(kind in (None, FULL) for kind in kinds)
        if self.direct:
            kinds = [FULL] * len(kinds)  # device-resident rows are left unfilled, overwritten
        self.kinds, self.lengths = kinds, lengths
        self.at: list[int] = []  # each segment's first row in its group
        self.column: list[int] = []  # each segment's column in int8.k_scale (int8 only)
        rows: dict[str, list[int]] = {}
        row_column: list[int] = []  # each int8 row's column in int8.k_scale
        start, scales = 0, 0
        for kind, n in zip(kinds, lengths, strict=True):
            group = [] if kind is None else rows.setdefault(kind, [])
            self.at.append(len(group))
            self.column.append(scales)
            if kind == INT8:
                row_column += [scales] * n
                scales += 1
            group.extend(range(start, start + n))
            start += n
        self.scales = scales
        self.sizes = {group: len(r) for group, r in rows.items()}
        # uploaded once: each group's rows in the prompt, each int8 row's K-scale column
        index = {**rows, "int8.k_scale": row_column} if not self.direct else {}
        self.index = {g: torch.tensor(r, dtype=torch.long, device=device) for g, r in index.items()}

    def buffers(
        self, heads: int, dim: int, dtype: torch.dtype, pin: bool
    ) -> dict[str, torch.Tensor]:
        """One ring slot's host buffers (see the class)."""
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for group, n in self.sizes.items():
            stored = {FULL: dtype, INT8: torch.int8}.get(group) or FLOAT_KV_DTYPES[group]
            shapes[f"{group}.k"] = shapes[f"{group}.v"] = ((1, heads, n, dim), stored)
        if INT8 in self.sizes:
            shapes["int8.k_scale"] = ((heads, self.scales, dim), torch.float32)
            shapes["int8.v_scale"] = ((1, heads, self.sizes[INT8], 1), torch.float32)
        return {n: torch.empty(s, dtype=t, pin_memory=pin) for n, (s, t) in shapes.items()}

    def fill(
        self, host: dict[str, torch.Tensor], i: int, cache: KVEntry | None, layer: int
    ) -> None:
        """Stage segment ``i``'s layer ``layer`` (as stored) into its group's rows of ``host``."""
        group, rows = self.kinds[i], slice(self.at[i], self.at[i] + self.lengths[i])
        hk, hv = host[f"{group}.k"][0, :, rows], host[f"{group}.v"][0, :, rows]
        if cache is None:
            hk.zero_()
            hv.zero_()
            return
        if group == FULL:
            ck, cv = cache.layer(layer)
        else:
            stored = cache.stored_layer(layer)
            ck, cv = stored["k"], stored["v"]
            if group == INT8:
                host["int8.v_scale"][0, :, rows].copy_(stored["v_scale"])
                host["int8.k_scale"][:, self.column[i]].copy_(stored["k_scale"][:, 0])
        hk.copy_(ck)
        hv.copy_(cv)

    def widen(self, moved: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor) -> None:
        """Every group of ``moved`` (a slot's buffers on the device) into its rows of ``k`` and
        ``v`` [1, Hkv, N, d], widened as ``quant.decode_layer`` does: per int8 layer
        ``index_select`` (K scales → rows), 2 casts, 2 multiplies, 2 casts to the compute dtype
        (none for fp32); per narrow float 2 casts; per group 2 ``index_copy_``."""
        for group in self.sizes:
            pk, pv, rows = moved[f"{group}.k"], moved[f"{group}.v"], self.index[group]
            if group == INT8:
                k_scale = moved["int8.k_scale"].index_select(1, self.index["int8.k_scale"])
                pk = pk.float() * k_scale
                pv = pv.float() * moved["int8.v_scale"]
            k.index_copy_(2, rows, pk.to(k.dtype))
            v.index_copy_(2, rows, pv.to(v.dtype))


def _kind(cache: KVEntry | None, resident: bool, dtype: torch.dtype) -> str | None:
    """How a segment is staged: None (device-resident), ``"full"`` (in the compute dtype, or
    zeros), ``"int8"``, or its float storage dtype's name where narrower than ``dtype``."""
    if resident:
        return None
    meta = getattr(cache, "meta", None) or {}
    if FLOAT_KV_DTYPES.get(meta.get("compute_dtype", "")) != dtype:  # widened on the host
        return FULL
    stored = meta.get("kv_dtype", "")
    if stored == INT8:
        return INT8
    narrow = FLOAT_KV_DTYPES.get(stored)
    return stored if narrow is not None and narrow.itemsize < dtype.itemsize else FULL


def _resident(cache: KVEntry | None, device: torch.device) -> bool:
    """Whether a cache entry's tensors already live on the (non-CPU) compute device: RAM-tier
    entries may, when the KV was put there on the device."""
    if device.type == "cpu" or not isinstance(cache, ChunkKV):
        return False
    return cache.k.device.type == device.type
