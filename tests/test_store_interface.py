"""The store interface tells the truth: every tier is a ``KVStore`` whose ``get`` returns a
``KVEntry``, and a new tier written against the two protocols alone serves the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import CHUNKS, QUESTION, tiny_model

from ragblend import BlendConfig, BlendEngine
from ragblend.store import KVEntry, KVStore, MemoryStore, StoreStats, make_store, pack
from ragblend.store.quant import from_stored


class DictTier:
    """A tier that persists what the protocol says to persist: ``meta`` and each layer's
    ``stored_layer(i)`` (as a remote tier would serialise them), rebuilt with ``from_stored``."""

    tier = "dict"
    prefetch_depth = 2

    def __init__(self) -> None:
        self.stats = StoreStats()
        self._items: dict[str, tuple[dict, list[dict[str, torch.Tensor]]]] = {}

    def get(self, key: str) -> KVEntry | None:
        item = self._items.get(key)
        self.stats.count("hits" if item else "misses")
        if item is None:
            return None
        meta, layers = item
        return from_stored(dict(meta), {n: torch.stack([t[n] for t in layers]) for n in layers[0]})

    def put(self, key: str, kv: KVEntry) -> None:
        layers = [
            {n: t.clone() for n, t in kv.stored_layer(i).items()} for i in range(kv.num_layers)
        ]
        self._items[key] = (dict(kv.meta), layers)

    def discard(self, key: str) -> None:
        self._items.pop(key, None)

    def __contains__(self, key: str) -> bool:
        return key in self._items

    def drop_page_cache(self) -> bool:
        return False

    def close(self) -> None:
        self._items.clear()


def make_engine(tokenizer, store, kv_dtype: str) -> BlendEngine:
    return BlendEngine(tiny_model("qwen2"), tokenizer, BlendConfig(kv_dtype=kv_dtype), store)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8"])
def test_a_tier_written_against_the_protocols_alone_serves_the_engine(kv_dtype, tokenizer):
    tier = DictTier()
    assert isinstance(tier, KVStore)
    engine = make_engine(tokenizer, tier, kv_dtype)
    reference = make_engine(tokenizer, MemoryStore(), kv_dtype)
    for e in (engine, reference):
        e.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    got = engine.prefill(prompt, mode="blend")
    want = reference.prefill(reference.tokenize(QUESTION, CHUNKS), mode="blend")
    assert got.stats.chunk_hits == len(CHUNKS)
    assert torch.equal(got.logits, want.logits)


@pytest.mark.parametrize("tier", ["ram", "disk", "tiered"])
@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_every_tier_is_a_kv_store_and_hands_out_kv_entries(tier, kv_dtype, tmp_path):
    store = make_store(tier, path=tmp_path, fsync=False)
    assert isinstance(store, KVStore)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 3, 2, 6, 8, generator=g)
    from ragblend.store import ChunkKV

    entry = pack(ChunkKV(k, v, {"fingerprint": "f", "dtype": "torch.float32"}), kv_dtype)
    assert isinstance(entry, KVEntry)
    store.put("key", entry)
    if tier == "tiered":
        store.ram.clear()
    got = store.get("key")
    assert isinstance(got, KVEntry)
    assert got.num_tokens == 6 and got.num_layers == 3 and got.nbytes == entry.nbytes
    assert set(got.stored_layer(1)) == set(entry.stored_layer(1))
    assert torch.equal(got.materialize().k, entry.materialize().k)
    assert isinstance(store.drop_page_cache(), bool)
    store.close()
