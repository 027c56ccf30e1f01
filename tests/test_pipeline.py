"""Layer-wise loading: order, bounded prefetch, error propagation, engine wiring."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from conftest import CHUNKS, QUESTION, tiny_model

from ragblend import BlendConfig, BlendEngine, chunk_cache, threads
from ragblend.errors import CorruptEntryError
from ragblend.fusion import layer_loader
from ragblend.fusion import staging as staging_module
from ragblend.fusion.layer_loader import LayerLoader
from ragblend.store import ChunkKV, DiskStore, MemoryStore, TieredStore

LAYERS, HEADS, DIM = 8, 2, 4


def kv(tokens: int, seed: int) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, HEADS, tokens, DIM)
    return ChunkKV(torch.randn(shape, generator=g), torch.randn(shape, generator=g))


class RecordingKV:
    """A ChunkKV look-alike that records which layers were read (and may fail on one)."""

    def __init__(self, inner: ChunkKV, fail_at: int | None = None) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.reads: list[int] = []
        self.lock = threading.Lock()

    def layer(self, index: int):
        with self.lock:
            self.reads.append(index)
        if index == self.fail_at:
            raise CorruptEntryError("deadbeef" * 8, f"checksum mismatch in layer {index}")
        return self.inner.layer(index)


def loader(caches, lengths, prefetch: int, staging: bool = False) -> LayerLoader:
    return LayerLoader(
        caches, lengths, LAYERS, HEADS, DIM, "cpu", torch.float32, prefetch, staging=staging
    )


def expected_layer(caches, lengths, layer):
    parts_k, parts_v = [], []
    for cache, n in zip(caches, lengths, strict=True):
        if cache is None:
            parts_k.append(torch.zeros(HEADS, n, DIM))
            parts_v.append(torch.zeros(HEADS, n, DIM))
        else:
            k, v = cache.layer(layer)
            parts_k.append(k)
            parts_v.append(v)
    return torch.cat(parts_k, 1)[None], torch.cat(parts_v, 1)[None]


def no_loader_threads() -> bool:
    return not any(t.name == "ragblend-layer-loader" for t in threading.enumerate())


@pytest.mark.parametrize("staging", [False, True])  # True: the CUDA path's host ring, on CPU
@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_layers_come_in_order_with_every_segment_in_place(prefetch, staging, tmp_path):
    disk = DiskStore(tmp_path, 1 << 30, fsync=False)
    disk.put("c", kv(5, 2))
    caches = [kv(3, 0), None, disk.get("c"), kv(4, 1), None]
    lengths = [3, 2, 5, 4, 1]
    seen = []
    for layer, k, v in loader(caches, lengths, prefetch, staging):
        want_k, want_v = expected_layer(caches, lengths, layer)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        seen.append(layer)
    assert seen == list(range(LAYERS))
    assert no_loader_threads()


def test_loaded_tensors_are_copies_the_consumer_may_modify():
    cache = kv(3, 0)
    original = cache.k.clone()
    for _, k, _ in loader([cache], [3], prefetch=2):
        k.add_(1.0)
    assert torch.equal(cache.k, original)


@pytest.mark.parametrize("prefetch", [1, 2])
def test_reader_never_gets_more_than_the_prefetch_depth_ahead(prefetch):
    cache = RecordingKV(kv(3, 0))
    lo = loader([cache], [3], prefetch)
    for consumed, (layer, _, _) in enumerate(lo, start=1):
        with cache.lock:
            read = len(cache.reads)
        assert read <= consumed + prefetch + 1  # + queued layers + the one the reader holds
        assert layer == consumed - 1
    assert cache.reads == list(range(LAYERS))
    assert 1 <= lo.max_ahead <= prefetch + 1


@pytest.mark.parametrize("staging", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_reader_exception_reaches_the_consumer_at_its_layer(prefetch, staging):
    caches = [kv(3, 0), RecordingKV(kv(2, 1), fail_at=3)]
    seen = []
    with pytest.raises(CorruptEntryError, match="layer 3"):
        for layer, _, _ in loader(caches, [3, 2], prefetch, staging):
            seen.append(layer)
    assert seen == [0, 1, 2]
    assert no_loader_threads()


def test_a_consumer_that_stops_early_does_not_leave_the_reader_running():
    cache = RecordingKV(kv(3, 0))
    it = iter(loader([cache], [3], prefetch=2))
    next(it)
    next(it)
    it.close()
    assert no_loader_threads()
    assert len(cache.reads) < LAYERS + 1


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_consumer_in_inference_mode_gets_every_layer_through_the_staging_ring(prefetch):
    # The ring is made in the consumer's inference mode; a reader thread outside it could not
    # write those tensors ("Inplace update to inference tensor outside InferenceMode"): the
    # failure the CUDA disk tier had.
    caches = [kv(3, 0), None, kv(4, 1)]
    with torch.inference_mode():
        got = [(k.clone(), v.clone()) for _, k, v in loader(caches, [3, 2, 4], prefetch, True)]
    for layer, (k, v) in enumerate(got):
        want_k, want_v = expected_layer(caches, [3, 2, 4], layer)
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert no_loader_threads()


class RecordingEvent:
    def __init__(self, log: list, name: int) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(("wait", self.name))


class RecordingCopies(staging_module.HostCopies):
    """The CPU copy engine, recording every event made and waited on."""

    def __init__(self, device) -> None:
        super().__init__(device)
        self.log: list = []
        self.events = 0

    def record(self):
        self.events += 1
        self.log.append(("record", self.events))
        return RecordingEvent(self.log, self.events)


@pytest.mark.parametrize("prefetch", [1, 3])
def test_the_staging_ring_refills_a_buffer_only_after_its_last_copy_finished(prefetch, monkeypatch):
    made = []

    def copies_for(device):
        made.append(RecordingCopies(device))
        return made[-1]

    monkeypatch.setattr(layer_loader, "copies_for", copies_for)
    lo = loader([kv(3, 0), kv(2, 1)], [3, 2], prefetch, staging=True)
    hand_overs = 0
    for _ in lo:
        hand_overs += 1
    log = made[0].log
    # per layer: the ring slot's copy event, then the layer's ready event (recorded in order)
    recorded = [name for what, name in log if what == "record"]
    assert len(recorded) == 2 * LAYERS and hand_overs == LAYERS
    slots = prefetch + 1
    for layer in range(LAYERS):
        copy_event, ready_event = 2 * layer + 1, 2 * layer + 2
        assert ("wait", ready_event) in log  # the consumer waited for its layer
        if layer + slots < LAYERS:  # the slot is refilled for layer + slots after this copy
            refill = log.index(("record", 2 * (layer + slots) + 1))
            assert log.index(("wait", copy_event)) < refill
        else:
            assert ("wait", copy_event) not in log  # nothing waits for the last copies


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pipeline_matches_the_cpu_loader():
    host = kv(6, 0)
    device_kv = ChunkKV(host.k.cuda(), host.v.cuda())
    caches = [host, None, device_kv, kv(3, 4)]
    lengths = [6, 2, 6, 3]
    cpu = [(k, v) for _, k, v in loader(caches, lengths, 0)]
    gpu = LayerLoader(caches, lengths, LAYERS, HEADS, DIM, "cuda", torch.float32, prefetch=2)
    for layer, k, v in gpu:
        assert k.is_cuda and v.is_cuda
        assert torch.equal(k.cpu(), cpu[layer][0]) and torch.equal(v.cpu(), cpu[layer][1])


@pytest.mark.parametrize("free_core", [True, False])
def test_engine_prefetches_for_disk_stores_only_and_only_with_a_core_free(
    free_core, tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setattr(chunk_cache, "core_free_for_a_reader", lambda device: free_core)
    model = tiny_model("llama")
    for store, depth in [
        (MemoryStore(), 0),
        (DiskStore(tmp_path / "d", 1 << 30, fsync=False), 2),
        (TieredStore(MemoryStore(), DiskStore(tmp_path / "t", 1 << 30, fsync=False)), 2),
    ]:
        engine = BlendEngine(model, tokenizer, BlendConfig(), store)
        assert engine.chunks.loader([]).prefetch == (depth if free_core else 0)


def test_a_cpu_reader_needs_more_cores_than_torch_threads(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    assert not threads.core_free_for_a_reader(torch.device("cpu"))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores - 1)
    assert threads.core_free_for_a_reader(torch.device("cpu"))
    assert threads.core_free_for_a_reader(torch.device("cuda"))


@pytest.mark.parametrize("free_core", [True, False])  # read ahead on a thread, or when due
@pytest.mark.parametrize("tier", ["disk", "tiered"])
def test_pipelined_disk_prefill_equals_the_ram_store_prefill(
    tier, free_core, tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setattr(chunk_cache, "core_free_for_a_reader", lambda device: free_core)
    model = tiny_model("qwen3")
    ram = BlendEngine(model, tokenizer, BlendConfig(), MemoryStore())
    disk = DiskStore(tmp_path, 1 << 30, fsync=False)
    store = disk if tier == "disk" else TieredStore(MemoryStore(), disk)
    engine = BlendEngine(model, tokenizer, BlendConfig(), store)
    for e in (ram, engine):
        e.precompute(CHUNKS)
    prompt = ram.tokenize(QUESTION, CHUNKS)
    for mode in ("blend", "reuse"):
        want = ram.prefill(prompt, mode=mode)
        got = engine.prefill(prompt, mode=mode)
        assert got.stats.chunk_hits == len(CHUNKS)
        assert torch.equal(got.logits, want.logits)
