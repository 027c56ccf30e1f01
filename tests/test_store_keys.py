"""Content keys: order independence, model/dtype sensitivity, stored tensors never mutated."""

from __future__ import annotations

import torch
from conftest import CHUNKS, QUESTION, tiny_model
from helpers import engine_for

from ragblend.store import MemoryStore
from ragblend.store.base import ChunkKV


def test_permuted_chunk_order_still_hits_every_chunk(tokenizer):
    engine = engine_for(tiny_model("llama"), tokenizer)
    engine.precompute(CHUNKS)
    for order in ([2, 0, 1], [1, 2, 0]):
        out = engine.prefill(engine.tokenize(QUESTION, [CHUNKS[i] for i in order]), "blend")
        assert (out.stats.chunk_hits, out.stats.chunk_misses) == (3, 0)


def test_other_model_or_dtype_misses(tokenizer):
    engine = engine_for(tiny_model("llama", seed=0), tokenizer)
    engine.precompute(CHUNKS)
    other_weights = engine_for(tiny_model("llama", seed=1), tokenizer)
    other_weights.store = engine.store
    other_dtype = engine_for(tiny_model("llama", seed=0, dtype=torch.bfloat16), tokenizer)
    other_dtype.store = engine.store
    for other in (other_weights, other_dtype):
        assert other.fingerprint != engine.fingerprint or other.layers.dtype != engine.layers.dtype
        out = other.prefill(other.tokenize(QUESTION, CHUNKS), "blend")
        assert (out.stats.chunk_hits, out.stats.chunk_misses) == (0, 3)
    assert all(engine.is_cached(c) for c in CHUNKS)


def test_fusion_leaves_the_stored_cache_unchanged(tokenizer):
    engine = engine_for(tiny_model("qwen3"), tokenizer, ratio=0.5, kv_dtype="float32")
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    context = engine.chunks.context_ids(prompt.head)
    keys = [engine.chunk_key(context_ids=context, chunk_ids=c) for c in prompt.chunks]
    before = [(engine.store.get(k).k.clone(), engine.store.get(k).v.clone()) for k in keys]
    for mode in ("blend", "reuse"):
        engine.generate(QUESTION, CHUNKS, mode=mode, max_new_tokens=4)
    for key, (k, v) in zip(keys, before):
        assert torch.equal(engine.store.get(key).k, k)
        assert torch.equal(engine.store.get(key).v, v)


def test_memory_store_evicts_least_recently_used_within_byte_bound():
    def entry(fill):
        return ChunkKV(torch.full((1, 1, 4, 2), float(fill)), torch.zeros(1, 1, 4, 2))

    size = entry(0).nbytes
    store = MemoryStore(capacity_bytes=2 * size)
    store.put("a", entry(1))
    store.put("b", entry(2))
    assert store.get("a") is not None  # a is now most recent
    store.put("c", entry(3))
    assert "b" not in store and "a" in store and "c" in store
    assert store.nbytes <= 2 * size
    assert store.stats.evictions == 1
