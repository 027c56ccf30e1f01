"""The store flags every command shares, and the one helper that opens their store."""

from __future__ import annotations

import logging

import pytest

from ragblend.cli import build_parser
from ragblend.errors import RagblendError
from ragblend.store import DiskStore, MemoryStore, TieredStore
from ragblend.store.cli import StoreFlags, open_store
from ragblend.store.layered import LayeredStore
from ragblend.store.redis import RedisStore

UNREACHABLE = "redis://127.0.0.1:9/0"  # the discard port: nothing answers Redis there


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["serve"],
        ["warmup", "--dataset", "d.json"],
        ["cache", "stats"],
        ["bench", "--dataset", "d.json", "--out", "o"],
    ],
)
def test_every_command_parses_the_same_store_flags(argv):
    args = parse(*argv, "--store-path", "/kv", "--namespace", "team-a")
    assert StoreFlags.of(args).store_path == "/kv"
    assert StoreFlags.of(args).namespace == "team-a"


@pytest.mark.parametrize("argv", [["serve"], ["warmup", "--dataset", "d.json"], ["cache", "gc"]])
def test_a_disk_and_a_redis_store_at_once_is_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv, "--store-path", "/kv", "--redis-url", "redis://h:6379/0")
    assert "not allowed with argument" in capsys.readouterr().err


def test_bench_reads_its_redis_url_only_for_the_redis_tier():
    args = parse("bench", "--dataset", "d.json", "--out", "o", "--store-path", "/kv")
    assert args.redis_url == "redis://127.0.0.1:6379/0" and args.store_path == "/kv"


def test_a_server_gets_a_ram_tier_in_front_of_the_disk(tmp_path):
    store = open_store(StoreFlags(str(tmp_path / "kv")), ram_front=True)
    assert isinstance(store, TieredStore)
    assert [type(t) for t in (store.ram, store.disk)] == [MemoryStore, DiskStore]
    assert store.disk.path == tmp_path / "kv"


def test_a_warmup_writes_the_disk_tier_with_its_capacity(tmp_path):
    args = parse(
        "warmup", "--dataset", "d.json", "--store-path", str(tmp_path), "--store-bytes", "1000"
    )
    store = open_store(StoreFlags.of(args))
    assert isinstance(store, DiskStore) and store.capacity_bytes == 1000


def test_inspecting_a_missing_store_is_one_clear_error(tmp_path):
    with pytest.raises(RagblendError, match="no KV store at"):
        open_store(StoreFlags(str(tmp_path / "nowhere")), existing=True)
    assert not (tmp_path / "nowhere").exists()


def test_an_unreachable_redis_fails_a_warmup_and_warns_a_server(caplog):
    with pytest.raises(RagblendError, match="cannot reach Redis"):
        open_store(StoreFlags(redis_url=UNREACHABLE), require_redis=True)
    with caplog.at_level(logging.WARNING, logger="ragblend.store.cli"):
        store = open_store(StoreFlags(redis_url=UNREACHABLE, namespace="t1"), ram_front=True)
    try:
        assert isinstance(store, LayeredStore)
        redis = store.tiers[-1]
        assert isinstance(redis, RedisStore) and redis.namespace == "t1"
        assert "unreachable" in caplog.text
    finally:
        store.close()
