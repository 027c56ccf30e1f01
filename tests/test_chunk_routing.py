"""Routing by chunk as a pure policy (no Ray): the affinity table, the choice, and finding a
request's chunks the way the server does."""

from __future__ import annotations

import json

import pytest

from ragblend.matching import ChunkIndex
from ragblend.serving.affinity import (
    AFFINITY,
    LOAD,
    NEW_CHUNKS,
    NO_CHUNK,
    AffinityTable,
    Choice,
    choose,
    chunk_id,
    request_chunks,
)

A = "The river Thames flows through London and into the North Sea estuary."
B = "Mount Everest is the highest mountain above sea level on the planet Earth."
C = "The novel was written by an author who lived in a small castle in Scotland."


def table_with(**owners: list[str]) -> AffinityTable:
    table = AffinityTable()
    for replica, ids in owners.items():
        table.record(ids, replica)
    return table


def test_the_replica_holding_most_of_a_requests_chunks_gets_it():
    table = table_with(r1=["a"], r2=["b", "c"])
    choice = choose(["a", "b", "c"], ["r1", "r2"], {"r1": 0, "r2": 1}, table, load_bound=4)
    assert choice == Choice("r2", AFFINITY)


def test_a_tie_in_chunks_goes_to_the_less_loaded_replica():
    table = table_with(r1=["a"], r2=["b"])
    assert choose(["a", "b"], ["r1", "r2"], {"r1": 3, "r2": 1}, table).replica == "r2"
    assert choose(["a", "b"], ["r1", "r2"], {"r1": 0, "r2": 1}, table).replica == "r1"


def test_beyond_the_load_bound_the_least_loaded_replica_takes_the_request():
    table = table_with(r1=["a", "b"])
    loads = {"r1": 6, "r2": 1, "r3": 2}
    within = choose(["a", "b"], ["r1", "r2", "r3"], loads, table, load_bound=5)
    beyond = choose(["a", "b"], ["r1", "r2", "r3"], loads, table, load_bound=4)
    assert within.replica == "r1" and within.reason == AFFINITY
    assert beyond.replica == "r2" and beyond.reason == LOAD


def test_requests_without_known_or_held_chunks_go_to_the_least_loaded_replica():
    table = table_with(r1=["a"])
    loads = {"r1": 2, "r2": 0, "r3": 0}
    assert choose([], ["r1", "r2", "r3"], loads, table) == Choice("r2", NO_CHUNK)
    fresh = choose(["zzz"], ["r1", "r3", "r2"], loads, table)
    assert fresh.replica == "r3" and fresh.reason == NEW_CHUNKS  # ties: the candidates' order


def test_new_chunks_go_to_the_idle_replica_holding_the_fewest_chunks():
    table = table_with(r1=["a", "b", "c"], r2=["d"])
    assert choose(["x"], ["r1", "r2"], {}, table) == Choice("r2", NEW_CHUNKS)
    assert choose(["x"], ["r1", "r2"], {"r2": 1}, table) == Choice("r1", NEW_CHUNKS)
    table.record(["d"], "r1")  # a chunk moves: r2 holds none now
    assert table.held("r1") == 4 and table.held("r2") == 0


def test_unknown_loads_count_as_idle_and_gone_replicas_hold_nothing():
    table = table_with(r1=["a"], r9=["b", "c"])  # r9 is not a candidate any more
    choice = choose(["a", "b", "c"], ["r1", "r2"], {"r1": None}, table)
    assert choice.replica == "r1" and choice.reason == AFFINITY
    assert table.forget("r9") == 2 and table.owner("b") is None


def test_the_table_keeps_the_latest_owner_and_the_most_recent_chunks():
    table = AffinityTable(capacity=3)
    table.record(["a", "b"], "r1")
    table.record(["b", "c"], "r2")
    assert table.owner("b") == "r2"
    table.record(["d"], "r1")  # "a" is the least recent: dropped
    assert len(table) == 3 and table.owner("a") is None
    assert table.counts(["b", "c", "d"]) == {"r2": 2, "r1": 1}


def test_invalid_policy_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="no candidate"):
        choose(["a"], [], {}, AffinityTable())
    with pytest.raises(ValueError, match="load_bound"):
        choose(["a"], ["r1"], {}, AffinityTable(), load_bound=-1)
    with pytest.raises(ValueError, match="capacity"):
        AffinityTable(0)


def test_chunk_ids_are_stable_and_distinct():
    assert chunk_id(A) == chunk_id(str(A)) and len(chunk_id(A)) == 16
    assert len({chunk_id(A), chunk_id(B), chunk_id(C)}) == 3


def test_a_requests_chunks_are_found_as_the_server_fuses_them():
    index = ChunkIndex()
    index.add([A, B, C])
    context = f"{A}\n\n{B}"
    chat = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You answer questions."},
            {"role": "user", "content": [{"type": "text", "text": f"Passages:\n{context}\n\nQ?"}]},
        ],
    }
    assert request_chunks("/v1/chat/completions", json.dumps(chat).encode(), index) == [A, B]
    completion = {"model": "m", "prompt": [f"{C}\n\n{A}\n\nAnswer:"]}
    assert request_chunks("/v1/completions", json.dumps(completion).encode(), index) == [C, A]
    warm = {"texts": [B, 3, C]}
    assert request_chunks("/v1/ragblend/chunks", json.dumps(warm).encode(), index) == [B, C]


def test_bodies_without_chunks_or_not_json_find_none():
    index = ChunkIndex()
    index.add([A])
    assert request_chunks("/v1/chat/completions", b"{not json", index) == []
    assert request_chunks("/v1/chat/completions", b"[1, 2]", index) == []
    assert request_chunks("/v1/completions", b'{"prompt": 5}', index) == []
    assert request_chunks("/tokenize", json.dumps({"prompt": A}).encode(), index) == []
    plain = {"messages": [{"role": "user", "content": "hello there"}]}
    assert request_chunks("/v1/chat/completions", json.dumps(plain).encode(), index) == []


def test_replica_metrics_merge_into_one_exposition_with_a_replica_label():
    from prometheus_client.parser import text_string_to_metric_families

    from ragblend.decode import BlendStats
    from ragblend.serving.metrics import ServerMetrics, merge_labelled

    a, b = ServerMetrics(), ServerMetrics()
    stats = BlendStats(mode="blend", prompt_tokens=10, chunk_hits=2)
    stats.extra["chunk_tiers"] = {"ram": 1, "redis": 1}
    a.first_token(stats)
    b.error(429)
    text = merge_labelled({"r1": a.render().decode(), "r2": b.render().decode()}).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert text.count("# TYPE ragblend:chunk_hits_total counter") == 1

    def totals(name: str) -> list:
        return [s for s in families[name].samples if s.name.endswith("_total")]

    hits = {s.labels["replica"]: s.value for s in totals("ragblend:chunk_hits")}
    assert hits == {"r1": 2.0, "r2": 0.0}
    tiers = {
        (s.labels["replica"], s.labels["tier"]): s.value for s in totals("ragblend:chunk_tier_hits")
    }
    assert tiers == {("r1", "ram"): 1.0, ("r1", "redis"): 1.0}
    assert [(s.labels, s.value) for s in totals("ragblend:request_errors")] == [
        ({"status": "429", "replica": "r2"}, 1.0)
    ]


def test_a_layered_store_says_which_tier_served_an_entry():
    import torch

    from ragblend.store.base import ChunkKV
    from ragblend.store.layered import LayeredStore, served_from
    from ragblend.store.memory import MemoryStore

    ram, lower = MemoryStore(), MemoryStore()
    lower.tier = "disk"
    store = LayeredStore([ram, lower])
    kv = ChunkKV(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), {})
    lower.put("k", kv)
    first = store.get("k")
    assert first is not None and served_from(store, first) == "disk"
    first.materialize()  # every layer read: promoted into the RAM tier
    again = store.get("k")
    assert again is not None and served_from(store, again) == "ram"
    assert served_from(lower, kv) == "disk"
