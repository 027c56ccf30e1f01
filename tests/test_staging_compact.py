"""Compact KV formats through the staging ring: staged as stored, widened on the device."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from ragblend.fusion import layer_loader
from ragblend.fusion import staging as staging_module
from ragblend.fusion.layer_loader import LayerLoader
from ragblend.store import ChunkKV, DiskStore
from ragblend.store.quant import pack

LAYERS, HEADS, DIM = 4, 2, 8


def kv(tokens: int, seed: int, dtype: torch.dtype) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, HEADS, tokens, DIM)
    meta = {"compute_dtype": str(dtype).removeprefix("torch.")}
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    return ChunkKV(k.to(dtype), v.to(dtype), meta)


def mixed(tmp_path, dtype: torch.dtype):
    """A prompt of every kind of segment: compute dtype, int8 (RAM and disk), bf16, no cache."""
    disk = DiskStore(tmp_path, 1 << 30, fsync=False)
    disk.put("q", pack(kv(5, 3, dtype), "int8"))
    disk.put("b", pack(kv(2, 6, dtype), "bfloat16"))
    caches = [
        kv(3, 0, dtype),
        pack(kv(4, 1, dtype), "int8"),
        None,
        pack(kv(6, 2, dtype), "bfloat16"),
        disk.get("q"),
        pack(kv(1, 4, dtype), "int8"),
        disk.get("b"),
        None,
    ]
    return caches, [3, 4, 2, 6, 5, 1, 2, 1]


def layers(caches, lengths, dtype, prefetch, staging):
    lo = LayerLoader(caches, lengths, LAYERS, HEADS, DIM, "cpu", dtype, prefetch, staging=staging)
    return [(k.clone(), v.clone()) for _, k, v in lo]


class RecordingCopies(staging_module.HostCopies):
    """The CPU copy engine, recording the dtype and shape of every host→device copy."""

    def __init__(self, device) -> None:
        super().__init__(device)
        self.moved: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def copy(self, dst, src) -> None:
        self.moved.append((src.dtype, tuple(src.shape)))
        super().copy(dst, src)


def recording(monkeypatch) -> list[RecordingCopies]:
    made: list[RecordingCopies] = []

    def copies_for(device):
        made.append(RecordingCopies(device))
        return made[-1]

    monkeypatch.setattr(layer_loader, "copies_for", copies_for)
    return made


@pytest.mark.parametrize("inference", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compact_segments_widened_after_the_copy_equal_the_host_widened_layers(
    dtype, prefetch, inference, tmp_path
):
    caches, lengths = mixed(tmp_path, dtype)
    with torch.inference_mode(inference):
        want = layers(caches, lengths, dtype, prefetch, staging=False)
        got = layers(caches, lengths, dtype, prefetch, staging=True)
    assert len(got) == LAYERS
    for (k, v), (want_k, want_v) in zip(got, want, strict=True):
        assert k.dtype == dtype and torch.equal(k, want_k) and torch.equal(v, want_v)


def test_the_copies_move_int8_codes_fp32_scales_and_bf16_not_widened_data(monkeypatch, tmp_path):
    made = recording(monkeypatch)
    caches, lengths = mixed(tmp_path, torch.float32)
    layers(caches, lengths, torch.float32, prefetch=2, staging=True)
    moved = made[0].moved
    per_layer = sorted(moved[: len(moved) // LAYERS], key=str)
    full, q, bf16 = 3 + 2 + 1, 4 + 5 + 1, 6 + 2  # rows of each group
    assert per_layer == sorted(
        [
            (torch.float32, (1, HEADS, full, DIM)),
            (torch.float32, (1, HEADS, full, DIM)),
            (torch.int8, (1, HEADS, q, DIM)),
            (torch.int8, (1, HEADS, q, DIM)),
            (torch.float32, (HEADS, 3, DIM)),  # K scales: one column per int8 segment
            (torch.float32, (1, HEADS, q, 1)),  # V scales: one per row
            (torch.bfloat16, (1, HEADS, bf16, DIM)),
            (torch.bfloat16, (1, HEADS, bf16, DIM)),
        ],
        key=str,
    )
    n = len(per_layer)
    assert len(moved) == LAYERS * n
    assert all(sorted(moved[i * n : (i + 1) * n], key=str) == per_layer for i in range(LAYERS))


def test_without_compact_segments_the_ring_moves_one_k_and_one_v(monkeypatch):
    made = recording(monkeypatch)
    caches = [kv(3, 0, torch.float32), None, pack(kv(2, 1, torch.float32), "float32")]
    layers(caches, [3, 2, 2], torch.float32, prefetch=0, staging=True)
    assert made[0].moved == [(torch.float32, (1, HEADS, 7, DIM))] * (2 * LAYERS)


def test_the_kernels_per_layer_do_not_grow_with_the_number_of_chunks(monkeypatch):
    calls: list[int] = []
    widen = staging_module.CompactLayout.widen

    def counting(self, moved, k, v):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            widen(self, moved, k, v)
        calls.append(sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")))

    monkeypatch.setattr(staging_module.CompactLayout, "widen", counting)
    for chunks in (2, 16):
        caches = [pack(kv(3, i, torch.float32), "int8") for i in range(chunks)]
        caches += [pack(kv(2, 99 + i, torch.float32), "bfloat16") for i in range(chunks)]
        layers(caches, [3] * chunks + [2] * chunks, torch.float32, prefetch=0, staging=True)
    assert len(calls) == 2 * LAYERS and len(set(calls)) == 1


@pytest.mark.parametrize("prefetch", [1, 3])
def test_compact_slots_are_refilled_only_after_their_last_copy(prefetch, monkeypatch, tmp_path):
    # (thread, entry): the consumer waits for each layer's ready event on its own thread while
    # the reader copies, so the reader's entries are read apart from the consumer's
    log: list = []
    names = itertools.count()

    def add(entry: tuple) -> None:
        log.append((threading.get_ident(), entry))

    class Event:
        def __init__(self, name: int) -> None:
            self.name = name

        def synchronize(self) -> None:
            add(("wait", self.name))

    class Copies(staging_module.HostCopies):
        def copy(self, dst, src) -> None:
            add(("copy", src.data_ptr()))
            super().copy(dst, src)

        def record(self):
            name = next(names)
            add(("record", name))
            return Event(name)

    monkeypatch.setattr(layer_loader, "copies_for", Copies)
    caches, lengths = mixed(tmp_path, torch.float32)
    layers(caches, lengths, torch.float32, prefetch, staging=True)
    reader = next(thread for thread, (what, _) in log if what == "copy")
    seq = [entry for thread, entry in log if thread == reader]
    records = [i for i, (what, _) in enumerate(seq) if what == "record"]
    slot_events = records[0::2]  # per layer: the slot's copy event, then the ready event
    assert len(slot_events) == LAYERS
    assert sum(what == "copy" for what, _ in seq) == sum(what == "copy" for _, (what, _) in log)
    for layer, at in enumerate(slot_events):
        name = seq[at][1]
        refill = layer + prefetch + 1
        copies = seq[at - 8 : at]  # the slot's buffers (8: see the test above)
        assert all(what == "copy" for what, _ in copies)
        if refill < LAYERS:  # the slot is refilled (same buffers) only after waiting for them
            assert seq[slot_events[refill] - 8 : slot_events[refill]] == copies
            assert seq.index(("wait", name)) < slot_events[refill] - 8
        else:
            assert ("wait", name) not in seq


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_widens_compact_segments_like_the_cpu_loader(dtype, tmp_path):
    caches, lengths = mixed(tmp_path, dtype)
    resident = kv(3, 9, dtype)
    caches.append(ChunkKV(resident.k.cuda(), resident.v.cuda(), resident.meta))
    lengths.append(3)
    want = layers(caches, lengths, dtype, prefetch=0, staging=False)
    gpu = LayerLoader(caches, lengths, LAYERS, HEADS, DIM, "cuda", dtype, prefetch=2)
    for layer, k, v in gpu:
        assert k.is_cuda and torch.equal(k.cpu(), want[layer][0])
        assert torch.equal(v.cpu(), want[layer][1])
