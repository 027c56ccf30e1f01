"""Layer-wise loading: order, bounded prefetch, error propagation, engine wiring."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from conftest import CHUNKS, QUESTION, tiny_model

from ragblend import BlendConfig, BlendEngine, chunk_cache, threads
from ragblend.errors import CorruptEntryError
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


def loader(caches, lengths, prefetch: int) -> LayerLoader:
    return LayerLoader(caches, lengths, LAYERS, HEADS, DIM, "cpu", torch.float32, prefetch=prefetch)


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


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_layers_come_in_order_with_every_segment_in_place(prefetch, tmp_path):
    disk = DiskStore(tmp_path, 1 << 30, fsync=False)
    disk.put("c", kv(5, 2))
    caches = [kv(3, 0), None, disk.get("c"), kv(4, 1)]
    lengths = [3, 2, 5, 4]
    seen = []
    for layer, k, v in loader(caches, lengths, prefetch):
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


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_reader_exception_reaches_the_consumer_at_its_layer(prefetch):
    caches = [kv(3, 0), RecordingKV(kv(2, 1), fail_at=3)]
    seen = []
    with pytest.raises(CorruptEntryError, match="layer 3"):
        for layer, _, _ in loader(caches, [3, 2], prefetch):
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
