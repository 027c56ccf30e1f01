"""Batched layer reads from the Redis tier: one round trip per layer for all of a query's
entries, bit-equal to per-entry reads, and damage between the header and the batched read is a
miss that the engine recomputes (real redis-server, no mocks)."""

from __future__ import annotations

import pytest
import redis_server as fixtures
import torch

from ragblend import BlendConfig, BlendEngine
from ragblend.errors import CorruptEntryError
from ragblend.fusion.layer_loader import LayerLoader
from ragblend.store import ChunkKV, MemoryStore
from ragblend.store.layered import LayeredStore, PromotedKV
from ragblend.store.quant import pack
from ragblend.store.redis import RedisStore, layer_field

redis_server = fixtures.redis_server

LAYERS, HEADS, DIM = 4, 2, 8


def entry(seed: int, tokens: int, kv_dtype: str) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(LAYERS, HEADS, tokens, DIM, generator=g).bfloat16()
    v = torch.randn(LAYERS, HEADS, tokens, DIM, generator=g).bfloat16()
    return pack(ChunkKV(k, v, {"fingerprint": "f", "dtype": "torch.bfloat16"}), kv_dtype)


def stored(store: RedisStore, kv_dtype: str, count: int = 3) -> list[str]:
    keys = []
    for j in range(count):
        key = f"{kv_dtype}-{j}".ljust(64, "0")
        store.put(key, entry(j, tokens=5 + j, kv_dtype=kv_dtype))
        keys.append(key)
    store.flush()
    return keys


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
@pytest.mark.parametrize("layers_per_fetch", [1, 3])
def test_batched_fetch_is_bit_equal_to_per_entry_reads_in_fewer_round_trips(
    redis_server, kv_dtype, layers_per_fetch
):
    store = RedisStore(redis_server.url, layers_per_fetch=layers_per_fetch)
    keys = stored(store, kv_dtype)
    one_by_one = [store.get(k) for k in keys]
    batched = [store.get(k) for k in keys]
    trips = store.layer_round_trips
    for i in range(LAYERS):
        store.fetch_layers(batched, i)
        for alone, together in zip(one_by_one, batched, strict=True):
            assert together.stored_layer(i).keys() == alone.stored_layer(i).keys()
            for name, t in alone.stored_layer(i).items():
                assert torch.equal(together.stored_layer(i)[name], t)
            k, v = together.layer(i)
            assert k.dtype == torch.bfloat16
            assert torch.equal(k, alone.layer(i)[0]) and torch.equal(v, alone.layer(i)[1])
    per_entry = -(-LAYERS // layers_per_fetch) * len(keys)  # one_by_one's reads
    batched_trips = -(-LAYERS // layers_per_fetch)
    assert store.layer_round_trips - trips == per_entry + batched_trips
    store.close()


def test_loader_reads_one_round_trip_per_layer_for_every_redis_entry(redis_server):
    """Redis entries, plain and read through a layered chain, next to a RAM entry and a gap."""
    store = RedisStore(redis_server.url, layers_per_fetch=1)
    keys = stored(store, "bfloat16")
    ram_kv = entry(9, tokens=4, kv_dtype="bfloat16")
    chain = LayeredStore([MemoryStore(), store])
    through_chain = chain.get(keys[2])
    assert isinstance(through_chain, PromotedKV)
    caches = [store.get(keys[0]), ram_kv, None, store.get(keys[1]), through_chain]
    lengths = [5, 4, 3, 6, 7]
    originals = [entry(0, 5, "bfloat16"), ram_kv, None, entry(1, 6, "bfloat16")]
    originals.append(entry(2, 7, "bfloat16"))
    loader = LayerLoader(caches, lengths, LAYERS, HEADS, DIM, "cpu", torch.bfloat16, prefetch=2)
    assert [len(entries) for _, entries in loader.batches] == [3]
    trips = store.layer_round_trips
    for i, k, v in loader:
        start = 0
        for kv, n in zip(originals, lengths, strict=True):
            want_k = torch.zeros(HEADS, n, DIM) if kv is None else kv.k[i]
            want_v = torch.zeros(HEADS, n, DIM) if kv is None else kv.v[i]
            assert torch.equal(k[0, :, start : start + n], want_k.bfloat16())
            assert torch.equal(v[0, :, start : start + n], want_v.bfloat16())
            start += n
        k.mul_(2)  # the fusor may modify the yielded tensors: they are the loader's own
    assert store.layer_round_trips - trips == LAYERS
    assert keys[2] in chain.tiers[0]  # read in full through the chain: promoted to RAM
    assert torch.equal(chain.get(keys[2]).layer(1)[0], entry(2, 7, "bfloat16").k[1])
    for i in range(LAYERS):  # the entries' own layers are untouched by the fusor's writes
        assert torch.equal(caches[0].layer(i)[0], entry(0, 5, "bfloat16").k[i])
        assert torch.equal(caches[4].layer(i)[0], entry(2, 7, "bfloat16").k[i])
    store.close()


def damage(store: RedisStore, key: str, how: str) -> None:
    name = store.redis_key(key)
    client = store.client
    if how == "evicted":
        client.delete(name)
    elif how == "corrupted":
        blob = bytearray(client.hget(name, layer_field(0)))
        blob[len(blob) // 2] ^= 0x01
        client.hset(name, layer_field(0), bytes(blob))
    else:  # something else now lives at the entry's name
        client.delete(name)
        client.set(name, b"not a hash")


@pytest.mark.parametrize("how", ["evicted", "corrupted", "replaced"])
def test_damage_between_header_and_batched_read_names_the_entry_and_keeps_the_rest(
    redis_server, how
):
    store = RedisStore(redis_server.url)
    keys = stored(store, "bfloat16")
    entries = [store.get(k) for k in keys]
    damage(store, keys[1], how)
    with pytest.raises(CorruptEntryError) as err:
        store.fetch_layers(entries, 0)
    assert err.value.key == keys[1]
    assert torch.equal(entries[2].layer(0)[0], entry(2, 7, "bfloat16").k[0])  # still served
    if how != "evicted":  # bad data is dropped: the next lookup is a clean miss
        assert store.get(keys[1]) is None
    assert keys[0] in store and keys[2] in store
    store.close()


class DamagingStore(RedisStore):
    """Damages one chunk's entry right after the query's lookups (headers read, no layer yet)."""

    victim = ""
    how = "evicted"
    damage_after_gets = 0

    def get(self, key):
        found = super().get(key)
        self.damage_after_gets -= 1
        if self.damage_after_gets == 0:
            damage(self, self.victim, self.how)
        return found


@pytest.mark.parametrize("how", ["evicted", "corrupted", "replaced"])
def test_chunk_damaged_mid_query_answers_as_if_it_had_missed(redis_server, tokenizer, how):
    from conftest import CHUNKS, QUESTION, tiny_model

    store = DamagingStore(redis_server.url)
    engine = BlendEngine(tiny_model("llama"), tokenizer, BlendConfig(), store)
    engine.precompute(CHUNKS)
    store.flush()
    prompt = engine.tokenize(QUESTION, CHUNKS)
    context = engine.chunks.context_ids(prompt.head)
    keys = [engine.chunk_key(context_ids=context, chunk_ids=c) for c in prompt.chunks]
    ram = BlendEngine(tiny_model("llama"), tokenizer, BlendConfig(), MemoryStore())
    ram.precompute(CHUNKS)
    ram.store.discard(keys[1])  # the same cache without the damaged chunk
    want = ram.prefill(prompt, mode="blend")

    store.victim, store.how = keys[1], how
    store.damage_after_gets = 1 + len(CHUNKS)  # the prompt head and every chunk: all hits
    got = engine.prefill(prompt, mode="blend")
    assert got.stats.chunk_misses == 1 and got.stats.chunk_hits == len(CHUNKS) - 1
    torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)
    assert keys[1] not in store and keys[0] in store and keys[2] in store
    store.close()
