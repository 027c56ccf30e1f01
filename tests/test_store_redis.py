"""The Redis tier against a real redis-server: layout, verification, faults, tenants."""

from __future__ import annotations

import json
import logging

import pytest
import redis_server as fixtures
import torch
from redis_server import RedisServer

from ragblend import BlendConfig, BlendEngine
from ragblend.errors import CorruptEntryError, RagblendError
from ragblend.store import ChunkKV, DiskStore, KVStore, MemoryStore, make_store
from ragblend.store.layered import LayeredStore
from ragblend.store.quant import pack
from ragblend.store.redis import HEADER, RedisStore, layer_field

redis_server = fixtures.redis_server


def entry(seed: int = 0, layers: int = 3, tokens: int = 5) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, 2, tokens, 4, generator=g)
    v = torch.randn(layers, 2, tokens, 4, generator=g)
    return pack(
        ChunkKV(k, v, {"fingerprint": "f", "dtype": "torch.float32", "tokens": tokens}), "float32"
    )


def written(store: RedisStore, key: str, kv) -> None:
    store.put(key, kv)
    store.flush()


def test_entry_round_trips_layer_by_layer_through_one_hash(redis_server):
    store = make_store("redis", url=redis_server.url)
    kv = entry()
    written(store, "a" * 64, kv)
    got = store.get("a" * 64)
    assert got is not None and store.tier == "redis" and store.prefetch_depth > 0
    assert (got.num_layers, got.num_tokens, got.nbytes) == (3, 5, kv.nbytes)
    assert got.meta["kv_dtype"] == "float32" and got.meta["fingerprint"] == "f"
    for i in range(3):
        k, v = got.layer(i)
        assert torch.equal(k, kv.k[i]) and torch.equal(v, kv.v[i])
    assert torch.equal(got.materialize().k, kv.k)
    client = store.client
    names = client.keys("ragblend:kv:*")
    assert names == [b"ragblend:kv:" + b"a" * 64]  # one key per entry: evicted as a unit
    fields = set(client.hkeys(names[0]))
    assert fields == {HEADER.encode()} | {layer_field(i).encode() for i in range(3)}
    header = json.loads(client.hget(names[0], HEADER))
    assert header["format"] == 1 and header["key"] == "a" * 64 and len(header["sums"]) == 3
    store.close()


def test_get_reads_only_the_header_and_a_missing_key_is_a_miss(redis_server):
    store = RedisStore(redis_server.url)
    assert store.get("b" * 64) is None and "b" * 64 not in store
    written(store, "b" * 64, entry())
    store.client.config_resetstat()
    got = store.get("b" * 64)
    assert got is not None and "b" * 64 in store
    info = store.client.info("commandstats")
    assert "cmdstat_hmget" not in info  # no layer fetched yet
    got.layer(0)
    assert store.client.info("commandstats")["cmdstat_hmget"]["calls"] == 1
    assert store.stats.as_dict()["hits"] == 1 and store.stats.as_dict()["misses"] == 1
    store.close()


def test_layers_per_fetch_reads_ahead_in_one_round_trip(redis_server):
    store = RedisStore(redis_server.url, layers_per_fetch=2)
    kv = entry(layers=4)
    written(store, "c" * 64, kv)
    got = store.get("c" * 64)
    store.client.config_resetstat()
    for i in range(4):
        assert torch.equal(got.layer(i)[0], kv.k[i])
    assert store.client.info("commandstats")["cmdstat_hmget"]["calls"] == 2
    store.close()


def test_corrupted_layer_raises_corrupt_entry_and_is_dropped(redis_server, caplog):
    store = RedisStore(redis_server.url, layers_per_fetch=1)  # layer 0 reads alone
    written(store, "d" * 64, entry())
    name = store.redis_key("d" * 64)
    blob = bytearray(store.client.hget(name, layer_field(1)))
    blob[-1] ^= 0xFF
    store.client.hset(name, layer_field(1), bytes(blob))
    assert store.check("d" * 64) == "layer 1 fails its checksum"
    got = store.get("d" * 64)
    got.layer(0)
    with caplog.at_level(logging.WARNING), pytest.raises(CorruptEntryError) as err:
        got.layer(1)
    assert err.value.key == "d" * 64
    assert store.get("d" * 64) is None  # dropped: the next lookup is a clean miss
    store.close()


@pytest.mark.parametrize("header", [b"not json", json.dumps({"format": 1, "key": "x"}).encode()])
def test_bad_header_is_a_miss_and_is_dropped(redis_server, header):
    store = RedisStore(redis_server.url)
    written(store, "e" * 64, entry())
    store.client.hset(store.redis_key("e" * 64), HEADER, header)
    assert store.get("e" * 64) is None
    assert store.client.exists(store.redis_key("e" * 64)) == 0
    store.close()


def test_header_of_another_format_version_is_a_miss_left_in_place(redis_server):
    store = RedisStore(redis_server.url)
    written(store, "f" * 64, entry())
    name = store.redis_key("f" * 64)
    header = json.loads(store.client.hget(name, HEADER))
    store.client.hset(name, HEADER, json.dumps({**header, "format": 99}))
    assert store.get("f" * 64) is None
    assert store.client.exists(name) == 1
    store.close()


def test_entry_evicted_between_header_and_layer_raises_corrupt_entry(redis_server):
    store = RedisStore(redis_server.url)
    written(store, "g" * 64, entry())
    got = store.get("g" * 64)
    store.client.delete(store.redis_key("g" * 64))
    with pytest.raises(CorruptEntryError, match="gone"):
        got.layer(0)
    store.close()


def test_namespaces_partition_the_key_space(redis_server):
    a = RedisStore(redis_server.url, namespace="tenant-a")
    b = RedisStore(redis_server.url, namespace="tenant-b")
    bare = RedisStore(redis_server.url)
    written(a, "h" * 64, entry())
    assert "h" * 64 in a and "h" * 64 not in b and "h" * 64 not in bare
    assert b.get("h" * 64) is None
    assert list(a.keys()) == ["h" * 64] and list(b.keys()) == [] and list(bare.keys()) == []
    for s in (a, b, bare):
        s.close()


def test_bad_urls_and_names_are_clear_errors():
    with pytest.raises(RagblendError, match="redis://"):
        RedisStore("http://localhost:6379")
    with pytest.raises(RagblendError, match="namespace"):
        RedisStore("redis://127.0.0.1:1/0", namespace="a b:c")


def test_unix_socket_url(tmp_path):
    sock = tmp_path / "r.sock"
    server = RedisServer(tmp_path, extra=["--unixsocket", str(sock), "--unixsocketperm", "700"])
    with server:
        store = RedisStore(f"unix://{sock}")
        written(store, "i" * 64, entry())
        assert torch.equal(store.get("i" * 64).layer(2)[1], entry().v[2])
        store.close()


def test_dead_server_is_misses_logged_once_and_hits_resume_after_restart(tmp_path, caplog):
    server = RedisServer(tmp_path).start()
    store = RedisStore(server.url, retry_s=0.0, connect_timeout=0.5, socket_timeout=0.5)
    kv = entry()
    written(store, "j" * 64, kv)
    got = store.get("j" * 64)
    server.stop()
    with caplog.at_level(logging.WARNING, logger="ragblend.store.redis"):
        with pytest.raises(CorruptEntryError, match="unreachable"):
            got.layer(0)
        for i in range(5):
            assert store.get("j" * 64) is None
            assert "j" * 64 not in store
            store.discard("j" * 64)
            store.put(f"{i:064x}", kv)
        store.flush()
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 1
    assert store.write_errors == 5
    server.start()  # same port, empty (no persistence): writes and hits resume
    written(store, "j" * 64, kv)
    assert torch.equal(store.get("j" * 64).layer(0)[0], kv.k[0])
    store.close()
    server.stop()


def test_memory_limit_evicts_whole_entries_without_errors(tmp_path):
    with RedisServer(tmp_path, maxmemory="4mb") as server:
        store = RedisStore(server.url, block_when_full=True)
        big = [entry(seed=i, layers=4, tokens=2048) for i in range(12)]  # ~0.5 MB each
        for i, kv in enumerate(big):
            store.put(f"{i:064x}", kv)
        store.flush()
        assert store.write_errors == 0
        assert store.server_info()["evicted_keys"] > 0
        hits = 0
        for i, kv in enumerate(big):
            got = store.get(f"{i:064x}")
            if got is not None:  # a surviving entry is complete: header and every layer
                hits += 1
                assert torch.equal(got.materialize().k, kv.k)
        assert 0 < hits < len(big)
        store.close()


def test_writes_are_asynchronous_and_pending_entries_are_served(redis_server):
    store = RedisStore(redis_server.url)
    kv = entry()
    store.put("l" * 64, kv)
    assert "l" * 64 in store and store.get("l" * 64) is not None  # pending or written
    store.close()  # drains the queue
    again = RedisStore(redis_server.url)
    assert torch.equal(again.get("l" * 64).layer(1)[0], kv.k[1])
    again.close()


# ---------------------------------------------------------------------- with an engine
def tiny_engine(tokenizer, store, namespace=None, seed=0) -> BlendEngine:
    from conftest import tiny_model

    model = tiny_model("llama", seed=seed)
    return BlendEngine(model, tokenizer, BlendConfig(namespace=namespace), store)


def test_blend_through_redis_equals_blend_through_ram(redis_server, tokenizer):
    from conftest import CHUNKS, QUESTION

    ram = tiny_engine(tokenizer, MemoryStore())
    remote = tiny_engine(tokenizer, RedisStore(redis_server.url))
    for engine in (ram, remote):
        engine.precompute(CHUNKS)
    remote.store.flush()
    prompt = ram.tokenize(QUESTION, CHUNKS)
    want = ram.prefill(prompt, mode="blend")
    got = remote.prefill(prompt, mode="blend")
    assert got.stats.chunk_hits == len(CHUNKS) and got.stats.chunk_misses == 0
    torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)
    remote.store.close()


def tenant_stores(kind: str, tmp_path, url: str) -> KVStore:
    if kind == "ram":
        return MemoryStore()
    if kind == "disk":
        return DiskStore(tmp_path / "kv", 1 << 30, fsync=False)
    if kind == "redis":
        return RedisStore(url)
    return LayeredStore(
        [MemoryStore(), DiskStore(tmp_path / "kv2", 1 << 30, fsync=False), RedisStore(url)]
    )


@pytest.mark.parametrize("kind", ["ram", "disk", "redis", "ram+disk+redis"])
def test_tenant_b_never_hits_tenant_a_entries(kind, redis_server, tokenizer, tmp_path):
    """One store shared by two tenants' engines: the namespace in every key keeps them apart."""
    from conftest import CHUNKS, QUESTION

    store = tenant_stores(kind, tmp_path, redis_server.url)
    a = tiny_engine(tokenizer, store, namespace="tenant-a")
    b = tiny_engine(tokenizer, store, namespace="tenant-b")
    assert a.precompute(CHUNKS) == len(CHUNKS)
    if kind != "ram" and kind != "disk":
        (store.tiers[-1] if isinstance(store, LayeredStore) else store).flush()
    assert all(a.is_cached(c) for c in CHUNKS)
    assert not any(b.is_cached(c) for c in CHUNKS)
    prompt = b.tokenize(QUESTION, CHUNKS)
    assert b.prefill(prompt, mode="blend").stats.chunk_hits == 0
    assert a.prefill(prompt, mode="blend").stats.chunk_hits == len(CHUNKS)
    assert b.precompute(CHUNKS) == len(CHUNKS)  # b computes its own copies
    store.close()


class KillingStore(RedisStore):
    """Kills the server right after the query's lookups, before its layers are fetched."""

    server: RedisServer
    kill_after_gets = 0

    def get(self, key):
        entry = super().get(key)
        self.kill_after_gets -= 1
        if self.kill_after_gets == 0:
            self.server.stop()
        return entry


def test_redis_killed_mid_query_answers_by_recomputing_and_hits_resume_after_restart(
    tmp_path, tokenizer, caplog
):
    from conftest import CHUNKS, QUESTION

    server = RedisServer(tmp_path).start()
    store = KillingStore(server.url, retry_s=0.0, connect_timeout=0.5, socket_timeout=0.5)
    store.server = server
    engine = tiny_engine(tokenizer, store)
    engine.precompute(CHUNKS)
    store.flush()
    prompt = engine.tokenize(QUESTION, CHUNKS)
    cold = tiny_engine(tokenizer, MemoryStore()).prefill(prompt, mode="blend")  # all misses
    store.kill_after_gets = 1 + len(CHUNKS)  # the prompt head and every chunk: all hits
    with caplog.at_level(logging.WARNING, logger="ragblend.store.redis"):
        killed = engine.prefill(prompt, mode="blend")
        again = engine.prefill(prompt, mode="blend")
    assert killed.stats.chunk_misses == len(CHUNKS) and again.stats.chunk_misses == len(CHUNKS)
    torch.testing.assert_close(killed.logits, cold.logits, atol=1e-5, rtol=0)
    assert len([r for r in caplog.records if "unreachable" in r.getMessage()]) == 1
    server.start()  # empty after the restart: warm it again, then hits resume
    engine.precompute(CHUNKS)
    store.flush()
    assert engine.prefill(prompt, mode="blend").stats.chunk_hits == len(CHUNKS)
    store.close()
    server.stop()


def test_corrupted_value_mid_query_is_a_miss_and_the_answer_equals_a_cold_run(
    redis_server, tokenizer
):
    from conftest import CHUNKS, QUESTION

    store = RedisStore(redis_server.url)
    engine = tiny_engine(tokenizer, store)
    engine.precompute(CHUNKS)
    store.flush()
    prompt = engine.tokenize(QUESTION, CHUNKS)
    key = engine.chunk_key(
        context_ids=engine.chunks.context_ids(prompt.head), chunk_ids=prompt.chunks[1]
    )
    name = store.redis_key(key)
    blob = bytearray(store.client.hget(name, layer_field(2)))
    blob[len(blob) // 2] ^= 0x01
    store.client.hset(name, layer_field(2), bytes(blob))
    damaged = engine.prefill(prompt, mode="blend")
    assert damaged.stats.chunk_misses == 1 and key not in store
    clean = engine.prefill(prompt, mode="blend")  # the entry is simply absent now
    torch.testing.assert_close(damaged.logits, clean.logits, atol=0, rtol=0)
    store.close()


def test_layered_chain_promotes_a_redis_hit_to_ram_and_disk(redis_server, tokenizer, tmp_path):
    remote = RedisStore(redis_server.url)
    kv = entry()
    written(remote, "n" * 64, kv)
    ram, disk = MemoryStore(), DiskStore(tmp_path, 1 << 30, fsync=False)
    chain = LayeredStore([ram, disk, remote])
    assert chain.tier == "ram+disk+redis" and chain.prefetch_depth == remote.prefetch_depth
    got = chain.get("n" * 64)
    got.layer(0)
    assert "n" * 64 not in ram  # partly read: not promoted yet
    assert torch.equal(got.materialize().v, kv.v)
    assert "n" * 64 in ram and "n" * 64 in disk
    assert torch.equal(chain.get("n" * 64).layer(1)[0], kv.k[1])  # served from RAM now
    assert remote.stats.hits == 1
    chain.close()


@pytest.mark.slow
def test_two_engine_processes_share_one_redis_warmed_in_one_hit_in_the_other(
    redis_server, tokenizer, tmp_path
):
    """examples/two_process_shared_tier.py: a warm process, then a query process, one Redis."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import tiny_model

    root = Path(__file__).resolve().parents[1]
    model = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(model)
    tokenizer.save_pretrained(model)
    cases = [
        {
            "question": f"Which city is in passage {q}?",
            "answers": ["x"],
            "ctxs": [
                {"title": "", "text": f"Passage {q}-{j}: the river city of {q * j}."}
                for j in range(3)
            ],
        }
        for q in range(2)
    ]
    dataset = tmp_path / "d.json"
    dataset.write_text(json.dumps(cases))
    out = subprocess.run(
        [
            sys.executable,
            str(root / "examples" / "two_process_shared_tier.py"),
            "--dataset",
            str(dataset),
            "--model",
            str(model),
            "--questions",
            "2",
            "--top-k",
            "3",
            "--chunk-tokens",
            "32",
            "--max-new-tokens",
            "2",
            "--redis-url",
            redis_server.url,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    warm = [line for line in out.splitlines() if line.startswith("[warm")]
    hits = [line.split()[1] for line in out.splitlines() if line.strip().startswith("hits")]
    assert "stored 6 chunks" in warm[0]
    assert hits == ["3/3", "3/3"]  # the other process's entries, fetched from Redis
    pids = {line.split()[2].rstrip("]") for line in out.splitlines() if line.startswith("[")}
    assert len(pids) == 2
