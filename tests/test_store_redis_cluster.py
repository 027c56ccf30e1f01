"""The shared KV tier on a real Redis Cluster: three masters with a replica each, started by the
fixture from Debian's redis-server; masters killed, shards lost and slots migrated under load."""

from __future__ import annotations

import json
import logging
import subprocess
import threading
import time

import pytest
import redis_cluster as fixtures
import test_warmup_ray
import torch
from test_store_redis import entry, tiny_engine, written

from ragblend.cli import main
from ragblend.store import MemoryStore, make_store
from ragblend.store.redis import RedisStore

redis_cluster = fixtures.redis_cluster
dataset, model_dir = test_warmup_ray.dataset, test_warmup_ray.model_dir


def owners(store: RedisStore, keys: list[str]) -> dict[str, int]:
    """The port of the master that serves each key's slot."""
    client = store.client
    return {key: client.get_node_from_key(store.redis_key(key)).port for key in keys}


def test_a_node_url_uses_the_whole_cluster_and_spreads_entries_over_every_master(redis_cluster):
    store = make_store("redis", url=redis_cluster.url)
    assert isinstance(store, RedisStore) and store.is_cluster() is True
    keys = [f"{i:064x}" for i in range(24)]
    for i, key in enumerate(keys):
        store.put(key, entry(seed=i))
    store.flush()
    assert store.write_errors == 0
    assert set(owners(store, keys).values()) == set(redis_cluster.master_ports())
    for i, key in enumerate(keys):
        got = store.get(key)
        assert got is not None
        want = entry(seed=i)
        for layer in range(want.num_layers):
            k, v = got.layer(layer)
            assert torch.equal(k, want.k[layer]) and torch.equal(v, want.v[layer])
    assert sorted(store.keys()) == sorted(keys)
    info = store.server_info()
    assert info["masters"] == 3 and info["used_memory"] > 0
    store.close()


def test_a_layer_read_is_one_pipeline_per_shard_holding_the_query(redis_cluster):
    store = RedisStore(redis_cluster.url, layers_per_fetch=1)
    keys = [f"{i:064x}" for i in range(12)]
    for i, key in enumerate(keys):
        store.put(key, entry(seed=i))
    store.flush()
    entries = [store.get(key) for key in keys]
    shards = len(set(owners(store, keys).values()))
    before = store.layer_round_trips
    store.fetch_layers(entries, 1)
    assert store.layer_round_trips - before == shards == 3
    for i, got in enumerate(entries):
        k, _ = got.layer(1)  # local now
        assert torch.equal(k, entry(seed=i).k[1])
    assert store.layer_round_trips - before == shards
    store.close()


def test_a_killed_master_fails_over_to_its_replica_and_every_entry_hits_again(redis_cluster):
    store = RedisStore(redis_cluster.url, retry_s=0.2)
    keys = [f"{i:064x}" for i in range(12)]
    for i, key in enumerate(keys):
        written(store, key, entry(seed=i))
    redis_cluster.wait_until_replicated()
    victim = owners(store, keys)[keys[0]]
    redis_cluster.kill_master(victim)  # returns once a replica serves its slots
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(store.get(key) for key in keys):
        time.sleep(0.2)  # the client learns the new slot map on its next error
    for i, key in enumerate(keys):
        got = store.get(key)
        assert got is not None and torch.equal(got.layer(2)[1], entry(seed=i).v[2])
    store.close()


def test_a_lost_shard_makes_only_its_entries_misses_and_blend_answers_as_without_them(
    redis_cluster, tokenizer, caplog
):
    from conftest import CHUNKS, QUESTION

    store = RedisStore(redis_cluster.url, retry_s=0.2, connect_timeout=0.5, socket_timeout=0.5)
    engine = tiny_engine(tokenizer, store)
    reference = tiny_engine(tokenizer, MemoryStore())
    for e in (engine, reference):
        e.precompute(CHUNKS)
    store.flush()
    prompt = engine.tokenize(QUESTION, CHUNKS)
    keys = list(store.keys())
    assert sorted(keys) == sorted(reference.store.keys())
    owner = owners(store, keys)
    lost = max(set(owner.values()), key=lambda port: sum(p == port for p in owner.values()))
    redis_cluster.kill_shard(lost)  # the master and its replica: no failover possible
    for key in keys:
        if owner[key] == lost:
            reference.store.discard(key)
    want = reference.prefill(prompt, mode="blend")
    with caplog.at_level(logging.WARNING, logger="ragblend.store.redis"):
        t0 = time.monotonic()
        got = engine.prefill(prompt, mode="blend")
        elapsed = time.monotonic() - t0
        again = engine.prefill(prompt, mode="blend")
    assert got.stats.chunk_misses == want.stats.chunk_misses > 0
    assert got.stats.chunk_hits == want.stats.chunk_hits > 0  # the other shards keep hitting
    torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)
    torch.testing.assert_close(again.logits, want.logits, atol=0, rtol=0)
    assert elapsed < 10
    down = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert down and all(f":{lost}" in r.getMessage() for r in down)
    store.close()


def test_a_slot_migration_under_load_fails_no_read_and_changes_no_value(redis_cluster):
    store = RedisStore(redis_cluster.url)
    keys = [f"{i:064x}" for i in range(16)]
    for i, key in enumerate(keys):
        written(store, key, entry(seed=i, layers=4, tokens=64))
    source = owners(store, keys)[keys[0]]
    target = next(p for p in redis_cluster.master_ports() if p != source)
    slot = store.client.keyslot(store.redis_key(keys[0]))
    errors: list[str] = []
    reads = 0
    stop = threading.Event()

    def load() -> None:
        nonlocal reads
        while not stop.is_set():
            for i, key in enumerate(keys):
                got = store.get(key)
                if got is None:
                    errors.append(f"miss {key[-4:]}")
                    continue
                store.fetch_layers([got], 0)
                if not torch.equal(got.layer(3)[0], entry(seed=i, layers=4, tokens=64).k[3]):
                    errors.append(f"wrong {key[-4:]}")
                reads += 1

    worker = threading.Thread(target=load)
    worker.start()
    try:
        redis_cluster.migrate_slot(slot, source, target)
    finally:
        time.sleep(0.5)  # reads after the move too
        stop.set()
        worker.join()
    assert owners(store, keys)[keys[0]] == target
    assert reads > len(keys) and errors == []
    store.close()


def test_the_fixture_stops_every_node(tmp_path):
    with fixtures.RedisClusterNodes(tmp_path) as cluster:
        pids = [node.proc.pid for node in cluster.nodes]
    alive = subprocess.run(["ps", "-o", "pid=", "-p", ",".join(map(str, pids))],
                           capture_output=True, text=True).stdout.split()  # fmt: skip
    assert alive == []


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0"])
def test_an_unreachable_cluster_url_is_a_plain_miss(url):
    store = RedisStore(url, connect_timeout=0.2)
    assert store.get("a" * 64) is None and store.is_cluster() is None
    store.close()


def test_warmup_cache_and_bench_commands_take_a_cluster_node_url(
    redis_cluster, dataset, model_dir, capsys, tmp_path
):
    url = redis_cluster.url
    warm = ["warmup", "--dataset", str(dataset), "--model", str(model_dir), "--top-k", "2",
            "--chunk-tokens", "32", "--no-progress", "--redis-url", url]  # fmt: skip
    assert main(warm) == 0
    capsys.readouterr()
    assert main(["cache", "stats", "--redis-url", url, "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    # 6 chunks, each with its first-chunk entry, + canonical and prompt heads
    assert stats["entries"] == 14 and stats["bytes"] > 0
    store = RedisStore(url)
    assert set(owners(store, list(store.keys())).values()) == set(redis_cluster.master_ports())
    store.close()
    assert main(["cache", "verify", "--redis-url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] == 14
    out = tmp_path / "bench"
    bench = ["bench", "--dataset", str(dataset), "--limit", "2", "--top-k", "2",
             "--chunk-tokens", "32", "--modes", "full,blend", "--repeats", "1",
             "--max-new-tokens", "2", "--model", str(model_dir), "--tier", "redis",
             "--redis-url", url, "--out", str(out)]  # fmt: skip
    assert main(bench) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["tier"] == "redis" and results["modes"]["blend"]["n"] == 2
