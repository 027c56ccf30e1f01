"""Disk and tiered KV tiers: exact round trips, lazy per-layer reads, LRU, integrity."""

from __future__ import annotations

import errno
import json
import logging
import os
import sqlite3

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import flip_last_layer_byte

from ragblend import BlendConfig, BlendEngine
from ragblend.errors import CorruptEntryError
from ragblend.store import (
    ChunkKV,
    DiskStore,
    MemoryStore,
    PromotingKV,
    TieredStore,
    codec,
    make_store,
)


def make_engine(family, tokenizer, store, seed=0, dtype=torch.float32) -> BlendEngine:
    return BlendEngine(tiny_model(family, seed=seed, dtype=dtype), tokenizer, BlendConfig(), store)


def random_kv(layers=3, heads=2, tokens=8, dim=16, dtype=torch.float32, seed=0) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, heads, tokens, dim, generator=g).to(dtype)
    v = torch.randn(layers, heads, tokens, dim, generator=g).to(dtype)
    return ChunkKV(k, v, {"fingerprint": "fp", "dtype": str(dtype), "context": "ctx"})


def entry_path(store: DiskStore, key: str):
    return store.data_dir / store._entry(key)["file"]


def assert_same_kv(got, want: ChunkKV) -> None:
    assert got is not None
    assert got.num_layers == want.num_layers and got.num_tokens == want.num_tokens
    assert got.nbytes == want.nbytes
    for i in range(want.num_layers):
        k, v = got.layer(i)
        assert k.dtype == want.k.dtype
        assert torch.equal(k, want.k[i]) and torch.equal(v, want.v[i])


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("tier", ["ram", "disk", "tiered"])
@pytest.mark.parametrize("family", FAMILIES)
def test_chunk_kv_of_every_family_round_trips_bit_exact_through_each_tier(
    family, tier, tokenizer, tmp_path
):
    engine = make_engine(family, tokenizer, MemoryStore())
    ids = tokenizer(CHUNKS[0], add_special_tokens=False)["input_ids"]
    kv = engine.chunks.compute_kv(ids, [])
    store = make_store(tier, path=tmp_path / "kv", fsync=False)
    store.put("k1", kv)
    if tier == "tiered":
        store.ram.clear()  # force the read through the disk tier
    got = store.get("k1")
    assert_same_kv(got, kv)
    assert got.meta["fingerprint"] == engine.fingerprint
    if tier != "ram":
        again = make_store(tier, path=tmp_path / "kv").get("k1")  # a fresh process's view
        assert_same_kv(again, kv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_entries_round_trip_and_are_valid_safetensors(dtype, tmp_path):
    from safetensors import safe_open

    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    kv = random_kv(dtype=dtype)
    store.put("half", kv)
    assert_same_kv(store.get("half"), kv)
    with safe_open(str(entry_path(store, "half")), "pt") as f:
        meta = f.metadata()
        assert torch.equal(f.get_tensor("v.2"), kv.v[2])
    assert meta["format"] == "ragblend-kv" and meta["dtype"] == str(dtype)
    assert len(json.loads(meta["checksums"])) == kv.num_layers


def test_reading_one_layer_reads_only_that_layers_bytes(tmp_path, monkeypatch):
    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    kv = random_kv(layers=6, tokens=32)
    store.put("k", kv)
    entry = store.get("k")
    reads = []
    real = os.preadv

    def spy(fd, buffers, offset):
        reads.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", spy)
    k, v = entry.layer(4)
    assert torch.equal(k, kv.k[4]) and torch.equal(v, kv.v[4])
    assert reads == [kv.nbytes // kv.num_layers]


def test_entry_records_fingerprint_dtype_context_tokens_and_version(tmp_path, tokenizer):
    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    # one entry per chunk: no first-chunk entry (exact_first_chunk) besides the heads
    engine = make_engine("llama", tokenizer, store).with_config(exact_first_chunk=False)
    engine.precompute(CHUNKS[:1])
    context = engine.chunks.context_ids(engine.prompt_head())
    (key,) = [k for k in store.keys() if k != engine.chunks.prefix_key(context)]
    meta = store._entry(key)
    assert meta["fingerprint"] == engine.fingerprint
    assert meta["dtype"] == "torch.float32"
    assert meta["version"] == codec.FORMAT_VERSION
    assert meta["context"] == engine.chunk_key(context_ids=context, chunk_ids=[])[:16]
    assert meta["tokens"] == len(tokenizer(CHUNKS[0], add_special_tokens=False)["input_ids"])


def greedy(engine, prefill, n: int) -> list[int]:
    return engine.greedy_answer(prefill, n)


# ---------------------------------------------------------------------- LRU
def test_lru_evicts_the_least_recently_used_entry_and_stays_within_capacity(tmp_path):
    kvs = {name: random_kv(seed=i) for i, name in enumerate("abcd")}
    probe = DiskStore(tmp_path / "probe", 1 << 30, fsync=False)
    probe.put("a", kvs["a"])
    entry_bytes = probe.nbytes
    store = DiskStore(tmp_path / "kv", 3 * entry_bytes + entry_bytes // 2, fsync=False)
    for name in "abc":
        store.put(name, kvs[name])
    assert store.get("a") is not None  # a becomes the most recently used
    store.put("d", kvs["d"])
    assert "b" not in store
    assert store.lru_keys() == ["c", "a", "d"]
    assert store.nbytes <= store.capacity_bytes
    assert store.disk_usage()["data"] == store.nbytes  # the file of b is gone too
    assert store.stats.evictions == 1 and store.counters()["evictions"] == 1
    for name in "acd":
        assert_same_kv(store.get(name), kvs[name])


def test_entry_larger_than_the_capacity_is_not_stored(tmp_path):
    store = DiskStore(tmp_path, 1000, fsync=False)
    store.put("big", random_kv(tokens=64))
    assert "big" not in store and store.nbytes == 0


def test_tiered_store_promotes_a_disk_hit_to_ram_once_fully_read(tmp_path):
    store = TieredStore(MemoryStore(1 << 30), DiskStore(tmp_path, 1 << 30, fsync=False))
    kv = random_kv()
    store.put("k", kv)
    assert "k" in store.ram and "k" in store.disk  # write-through
    store.ram.clear()
    lazy = store.get("k")
    assert isinstance(lazy, PromotingKV)
    lazy.layer(0)
    assert "k" not in store.ram  # partially read: not promoted yet
    assert_same_kv(lazy, kv)
    assert "k" in store.ram
    disk_hits = store.disk.stats.hits
    assert_same_kv(store.get("k"), kv)
    assert store.disk.stats.hits == disk_hits  # served from RAM


def test_entries_written_by_one_store_object_are_visible_to_another(tmp_path):
    a = DiskStore(tmp_path, 1 << 30, fsync=False)
    b = DiskStore(tmp_path, 1 << 30, fsync=False)
    kv = random_kv()
    a.put("k", kv)
    assert "k" in b
    assert_same_kv(b.get("k"), kv)
    b.put("k", random_kv(seed=5))  # already stored: no-op
    assert_same_kv(a.get("k"), kv)
    assert len(list(a.data_dir.glob("*/*.safetensors"))) == 1


# ---------------------------------------------------------------------- integrity
def _truncate(store, key):
    path = entry_path(store, key)
    os.truncate(path, path.stat().st_size - 64)


def _rewrite(store, key, kv, monkeypatch=None, version=None):
    """Replace an entry's file with one written from ``kv`` (optionally another version)."""
    path = entry_path(store, key)
    tmp = path.with_suffix(".rewrite")
    with monkeypatch.context() as m:
        if version is not None:
            m.setattr(codec, "FORMAT_VERSION", version)
        store._write(tmp, key, kv)
    os.replace(tmp, path)


def _foreign(store, key, monkeypatch, other_kv):
    _rewrite(store, key, other_kv, monkeypatch)


def _other_version(store, key, monkeypatch, other_kv):
    kv = store.get(key).materialize()
    _rewrite(store, key, kv, monkeypatch, version=codec.FORMAT_VERSION + 1)


def _half_written(store, key):
    entry_path(store, key).unlink()  # indexed, data never made it


def _index_version(store, key):
    with sqlite3.connect(store.index.path) as con:
        con.execute("UPDATE entries SET version=0 WHERE key=?", (key,))


DAMAGE = {
    "checksum": lambda s, k, mp, o: flip_last_layer_byte(s, k),
    "truncated": lambda s, k, mp, o: _truncate(s, k),
    "foreign": _foreign,
    "version": _other_version,
    "half-written": lambda s, k, mp, o: _half_written(s, k),
    "index-version": lambda s, k, mp, o: _index_version(s, k),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_entry_is_a_miss_and_the_answer_equals_a_run_without_it(
    damage, tokenizer, tmp_path, monkeypatch, caplog
):
    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    engine = make_engine("llama", tokenizer, store)
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    key = engine.chunk_key(
        context_ids=engine.chunks.context_ids(prompt.head), chunk_ids=prompt.chunks[1]
    )
    other = make_engine("llama", tokenizer, MemoryStore(), seed=1)
    other_kv = other.chunks.compute_kv(prompt.chunks[1], engine.chunks.context_ids(prompt.head))
    DAMAGE[damage](store, key, monkeypatch, other_kv)

    with caplog.at_level(logging.WARNING):
        damaged = engine.prefill(prompt, mode="blend")
    assert key not in store  # dropped
    assert damaged.stats.chunk_misses == 1 and damaged.stats.chunk_hits == 2
    assert sum(key[:16] in r.getMessage() for r in caplog.records) == 1  # logged once
    clean = engine.prefill(prompt, mode="blend")  # the entry is simply absent now
    assert clean.stats.chunk_misses == 1
    assert torch.equal(damaged.logits, clean.logits)
    assert greedy(engine, damaged, 6) == greedy(engine, clean, 6)


def test_a_corrupt_prompt_head_cache_is_recomputed_by_queries_and_precompute(tokenizer, tmp_path):
    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    engine = make_engine("llama", tokenizer, store)
    engine.precompute(CHUNKS[:2])
    prompt = engine.tokenize(QUESTION, CHUNKS[:2])
    prefix_key = engine.chunks.prefix_key(prompt.head)
    want = engine.prefill(prompt, mode="blend")
    flip_last_layer_byte(store, prefix_key)
    got = engine.prefill(prompt, mode="blend")  # the head's cache is recomputed and re-stored
    assert torch.equal(got.logits, want.logits) and prefix_key in store
    context_key = engine.chunks.prefix_key(
        engine.chunks.context_ids(prompt.head)
    )  # precompute's head
    flip_last_layer_byte(store, context_key)
    assert engine.precompute(CHUNKS[2:]) == 1
    assert store.verify()["corrupt"] == 0


def test_precompute_calls_between_layers_once_per_layer_and_stores_the_same_kv(tokenizer):
    calls = []
    hooked = make_engine("llama", tokenizer, MemoryStore())
    plain = make_engine("llama", tokenizer, MemoryStore())
    ids = hooked.tokenizer.encode(CHUNKS[0], add_special_tokens=False)
    head = hooked.prompt_head()
    assert hooked.precompute_ids(ids, head, lambda: calls.append(1))
    assert plain.precompute_ids(ids, head)
    # once per layer of each computation: the chunk's own entry and its first-chunk entry
    assert len(calls) == 2 * hooked.layers.num_layers
    key = hooked.chunks.key(context_ids=hooked.chunks.context_ids(head), chunk_ids=ids)
    got, want = hooked.store.get(key), plain.store.get(key)
    assert got is not None and want is not None
    assert torch.equal(got.materialize().k, want.materialize().k)


def test_checksum_mismatch_raises_corrupt_entry_error_and_drops_the_entry(tmp_path):
    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    store.put("k", random_kv())
    flip_last_layer_byte(store, "k")
    entry = store.get("k")  # the header is fine: the damage shows when the layer is read
    entry.layer(0)
    with pytest.raises(CorruptEntryError) as info:
        entry.layer(2)
    assert info.value.key == "k"
    assert "k" not in store and store.get("k") is None
    assert not list(store.data_dir.glob("*/*.safetensors"))


def test_an_open_entry_still_reads_after_another_store_evicts_it(tmp_path):
    a = DiskStore(tmp_path, 1 << 30, fsync=False)
    kv = random_kv()
    a.put("k", kv)
    entry = a.get("k")
    DiskStore(tmp_path, 1 << 30).discard("k")
    assert "k" not in a
    assert_same_kv(entry, kv)


def test_disk_full_during_put_is_logged_and_the_query_still_answers(
    tokenizer, tmp_path, monkeypatch, caplog
):
    def full(self, tmp, key, kv):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskStore, "_write", full)
    store = DiskStore(tmp_path, 1 << 30)
    engine = make_engine("llama", tokenizer, store)
    with caplog.at_level(logging.WARNING):
        engine.precompute(CHUNKS)
    assert len(store) == 0 and store.write_errors >= len(CHUNKS)
    assert store.last_write_error == "disk full"
    assert sum("could not write" in r.getMessage() for r in caplog.records) == 1
    assert not list(store.tmp_dir.iterdir())  # no temp file left behind
    reference = make_engine("llama", tokenizer, MemoryStore())
    got = engine.generate(QUESTION, CHUNKS, max_new_tokens=6)
    want = reference.generate(QUESTION, CHUNKS, max_new_tokens=6)
    assert got.stats.chunk_misses == len(CHUNKS)
    assert got.token_ids == want.token_ids


def test_verify_reports_bad_entries_and_gc_removes_them_with_orphans(tmp_path):
    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    for i, name in enumerate(["good", "flipped", "cut"]):
        store.put(name, random_kv(seed=i))
    flip_last_layer_byte(store, "flipped")
    _truncate(store, "cut")
    (store.tmp_dir / "dead.123.tmp").write_bytes(b"partial")
    orphan = store.data_dir / "zz" / "zz.orphan.safetensors"
    orphan.parent.mkdir()
    orphan.write_bytes(b"x" * 10)

    report = store.verify()
    assert report["ok"] == 1 and report["corrupt"] == 2
    assert {k for k, _ in report["errors"]} == {"flipped", "cut"}
    assert len(store) == 3  # verify alone changes nothing

    cleaned = store.gc(grace_s=0)
    assert cleaned["orphans"] == 1 and cleaned["stale_tmp"] == 1
    assert list(store.keys()) == ["good"]
    assert store.verify() == {"ok": 1, "corrupt": 0, "foreign": 0, "errors": []}
    assert store.nbytes == store.disk_usage()["data"]


def test_cache_cli_reports_stats_verifies_and_collects(tmp_path, capsys):
    from ragblend.cli import main

    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    store.put("a", random_kv())
    store.put("b", random_kv(seed=1))
    store.get("a")
    store.get("missing")
    assert main(["cache", "stats", "--store-path", str(tmp_path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 2
    assert stats["counters"] == {"hits": 1, "misses": 1, "puts": 2, "evictions": 0}
    assert stats["tiers"]["disk"]["bytes"] == store.nbytes

    flip_last_layer_byte(store, "b")
    assert main(["cache", "verify", "--store-path", str(tmp_path)]) == 1
    assert "corrupt 1" in capsys.readouterr().out
    assert main(["cache", "gc", "--store-path", str(tmp_path), "--max-bytes", "0"]) == 0
    out = capsys.readouterr().out
    assert "corrupt 1" in out and "evicted 1" in out
    assert len(store) == 0
    assert main(["cache", "stats", "--store-path", str(tmp_path / "nowhere")]) == 2


def test_drop_page_cache_is_supported_or_says_so(tmp_path):
    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    store.put("k", random_kv())
    assert store.drop_page_cache() is hasattr(os, "posix_fadvise")
    assert_same_kv(store.get("k"), random_kv())
