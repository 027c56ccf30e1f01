"""The disk tier's index is a cache of the entry files' headers: damaging it never takes a
query down — it is moved aside, rebuilt from the entry files, logged once, and answered."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3

import pytest
import torch
from conftest import CHUNKS, QUESTION, tiny_model

from ragblend import BlendConfig, BlendEngine
from ragblend.store import ChunkKV, DiskStore


def make_engine(tokenizer, store) -> BlendEngine:
    return BlendEngine(tiny_model("llama"), tokenizer, BlendConfig(), store)


def random_kv(seed: int = 0) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, 3, 2, 5, 8, generator=g)
    return ChunkKV(k, v, {"fingerprint": "fp", "dtype": "torch.float32", "context": "c"})


def flip_bytes(path, start: int = 0, step: int = 13) -> None:
    data = bytearray(path.read_bytes())
    for i in range(start, len(data), step):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


DAMAGE = {
    "flipped": lambda db: flip_bytes(db, start=100),  # keeps the 100-byte file header
    "flipped-header": lambda db: flip_bytes(db, start=0),
    "truncated": lambda db: os.truncate(db, db.stat().st_size // 2),
    "emptied": lambda db: os.truncate(db, 0),
    "garbage": lambda db: db.write_bytes(b"not a database" * 1000),
    "deleted": lambda db: db.unlink(),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_index_is_rebuilt_and_the_query_answers_as_on_a_clean_store(
    damage, tokenizer, tmp_path, caplog
):
    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    engine = make_engine(tokenizer, store)
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    clean = engine.prefill(prompt, mode="blend")
    assert clean.stats.chunk_hits == len(CHUNKS)
    keys = set(store.keys())
    store.close()
    DAMAGE[damage](store.index.path)

    with caplog.at_level(logging.WARNING):
        reopened = DiskStore(tmp_path, 1 << 30, fsync=False)
        got = make_engine(tokenizer, reopened).prefill(prompt, mode="blend")
    assert got.stats.chunk_hits == len(CHUNKS)  # rebuilt from the entry files' headers
    assert torch.equal(got.logits, clean.logits)
    assert set(reopened.keys()) == keys
    assert reopened.nbytes == reopened.disk_usage()["data"]
    damaged_logs = [r for r in caplog.records if "damaged" in r.getMessage()]
    assert len(damaged_logs) <= 1  # logged once (an emptied/deleted file is simply new)


def test_an_index_damaged_while_open_is_recovered_at_the_next_call(tmp_path, caplog):
    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    kvs = {f"k{i}": random_kv(i) for i in range(3)}
    for key, kv in kvs.items():
        store.put(key, kv)
    store.index.close()  # drop SQLite's page cache, as another process would not have it
    flip_bytes(store.index.path, start=100)
    with caplog.at_level(logging.WARNING):
        assert "k1" in store
        entry = store.get("k1")
        store.put("k9", random_kv(9))
    assert entry is not None and torch.equal(entry.layer(1)[0], kvs["k1"].k[1])
    assert set(store.keys()) == {*kvs, "k9"}
    assert sum("damaged" in r.getMessage() for r in caplog.records) == 1
    assert store.index.recoveries == 1


def test_a_damaged_write_ahead_log_is_a_miss_or_a_hit_never_an_error(tmp_path):
    live = DiskStore(tmp_path / "live", 1 << 30, fsync=False)
    kvs = {f"k{i}": random_kv(i) for i in range(3)}
    for key, kv in kvs.items():
        live.put(key, kv)
    wal = live.index.path.with_name("index.db-wal")
    assert wal.exists() and wal.stat().st_size > 0  # the rows are still in the WAL
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "live", copy)  # a snapshot as a crash would leave it
    flip_bytes(copy / "index" / "index.db-wal", start=64)
    store = DiskStore(copy, 1 << 30, fsync=False)
    for key, kv in kvs.items():
        entry = store.get(key)
        assert entry is None or torch.equal(entry.materialize().k, kv.k)
    store.put("new", random_kv(7))
    assert store.get("new") is not None
    assert store.verify()["corrupt"] == 0


def test_a_malformed_index_row_is_a_miss_and_never_names_a_missing_file(tmp_path):
    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    store.put("k", random_kv())
    store.put("other", random_kv(1))
    with pytest.raises(sqlite3.IntegrityError), sqlite3.connect(store.index.path) as con:
        con.execute("UPDATE entries SET file=NULL WHERE key='k'")  # the schema forbids it
    with sqlite3.connect(store.index.path) as con:
        con.execute("UPDATE entries SET bytes='garbage' WHERE key='k'")
    assert store.index.get("k") is None  # not {"file": None, ...}
    assert store.get("k") is None and "k" not in store
    assert store.gc(grace_s=0)["orphans"] == 1  # its file is collected as an orphan
    assert list(store.keys()) == ["other"]
    assert store.nbytes == store.disk_usage()["data"]


def test_cache_verify_rebuild_restores_the_index_offline(tmp_path, capsys):
    from ragblend.cli import main

    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    for i in range(3):
        store.put(f"k{i}", random_kv(i))
    store.close()
    flip_bytes(store.index.path, start=100)
    assert main(["cache", "verify", "--rebuild", "--store-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "rebuilt the index from 3 entry files" in out and "ok 3" in out
    assert len(DiskStore(tmp_path, 1 << 30)) == 3


def test_the_lru_order_comes_from_one_query_over_the_stamp_index(tmp_path):
    store = DiskStore(tmp_path, 1 << 30, fsync=False)
    for name in "abc":
        store.put(name, random_kv())
    store.get("a")
    assert store.lru_keys() == ["b", "c", "a"]
    with sqlite3.connect(store.index.path) as con:
        plan = con.execute("EXPLAIN QUERY PLAN SELECT key FROM entries ORDER BY stamp").fetchall()
    assert "entries_by_stamp" in str(plan)


def test_an_index_that_cannot_be_opened_at_all_leaves_every_call_a_miss(
    tokenizer, tmp_path, monkeypatch
):
    def broken(*args, **kwargs):
        raise sqlite3.DatabaseError("file is not a database")

    monkeypatch.setattr(sqlite3, "connect", broken)
    store = DiskStore(tmp_path, 1 << 30, fsync=False)  # does not raise
    store.put("k", random_kv())
    assert "k" not in store and store.get("k") is None and len(store) == 0
    assert not list(store.data_dir.glob("*/*.safetensors"))  # nothing written unindexed
    engine = make_engine(tokenizer, store)
    reference = make_engine(tokenizer, DiskStore(tmp_path / "other", 1 << 30, fsync=False))
    monkeypatch.undo()
    monkeypatch.setattr(sqlite3, "connect", broken)
    got = engine.generate(QUESTION, CHUNKS, max_new_tokens=4)
    monkeypatch.undo()
    want = reference.generate(QUESTION, CHUNKS, max_new_tokens=4)
    assert got.stats.chunk_misses == len(CHUNKS)
    assert got.token_ids == want.token_ids
