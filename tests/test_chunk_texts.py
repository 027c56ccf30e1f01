"""Chunk texts recorded with the store: every engine on a disk or Redis store matches them."""

from __future__ import annotations

import os
import stat

import redis_server as fixtures
from conftest import CHUNKS
from helpers import tiny_model

from ragblend import BlendConfig, BlendEngine
from ragblend.store import DiskStore, MemoryStore, TieredStore
from ragblend.store.chunk_texts import ChunkTexts, SqliteTexts
from ragblend.store.layered import LayeredStore
from ragblend.store.redis import RedisStore
from ragblend.warmup import WarmupQueue

redis_server = fixtures.redis_server


def engine(tokenizer, store, model=None, **config) -> BlendEngine:
    return BlendEngine(model or tiny_model("llama"), tokenizer, BlendConfig(**config), store=store)


def test_warmup_queue_records_texts_that_a_new_engine_on_the_disk_store_matches(
    tokenizer, tmp_path
):
    old = os.umask(0o022)
    try:
        writer = engine(tokenizer, DiskStore(tmp_path, fsync=False))
        with WarmupQueue(writer, workers=1) as queue:
            queue.submit(CHUNKS)
            queue.join()
    finally:
        os.umask(old)
    sqlite = tmp_path / "texts" / "chunk_texts.sqlite"
    assert stat.S_IMODE(sqlite.stat().st_mode) == 0o600
    assert stat.S_IMODE(sqlite.parent.stat().st_mode) == 0o700
    reader = engine(tokenizer, TieredStore(MemoryStore(), DiskStore(tmp_path, fsync=False)))
    prompt = "Context:\n" + "\n\n".join(CHUNKS) + "\nQ?"
    assert len(reader.known_chunks()) == len(CHUNKS)
    assert len(reader.known_chunks().spans(prompt)) == len(CHUNKS)
    writer.precompute(["A fourth chunk, long enough to be matched in prompts."])
    assert len(reader.known_chunks()) == len(CHUNKS) + 1  # read incrementally


def test_texts_are_scoped_by_model_and_namespace(tokenizer, tmp_path):
    engine(tokenizer, DiskStore(tmp_path, fsync=False), namespace="a").precompute(CHUNKS[:1])
    other_tenant = engine(tokenizer, DiskStore(tmp_path, fsync=False), namespace="b")
    other_model = engine(tokenizer, DiskStore(tmp_path, fsync=False), tiny_model("llama", seed=1))
    assert len(other_tenant.known_chunks()) == 0 and len(other_model.known_chunks()) == 0


def test_a_damaged_texts_file_is_a_miss_not_an_error(tokenizer, tmp_path):
    texts = SqliteTexts(tmp_path)
    texts.add("s", [("k", "text")])
    texts._conn = None
    texts.path.write_bytes(b"not a database" * 100)
    for suffix in ("-wal", "-shm"):
        texts.path.with_name(texts.path.name + suffix).unlink(missing_ok=True)
    assert texts.read("s", 0) == ([], 0)
    texts.add("s", [("k2", "more")])  # logged, not raised


def test_redis_texts_are_shared_and_a_dead_server_is_a_miss(tokenizer, redis_server):
    def store():
        return LayeredStore([MemoryStore(), RedisStore(redis_server.url, namespace="n1")])

    model = tiny_model("llama")
    writer = engine(tokenizer, store(), model)
    writer.precompute(CHUNKS)
    reader = engine(tokenizer, store(), model)
    assert len(reader.known_chunks()) == len(CHUNKS)
    texts = ChunkTexts(RedisStore(redis_server.url, namespace="n1"))
    assert sorted(texts.new_texts(writer.chunks.text_scope)) == sorted(CHUNKS)
    writer.precompute(CHUNKS)  # already recorded: no duplicates
    assert texts.new_texts(writer.chunks.text_scope) == []
    redis_server.stop()
    assert texts.new_texts(writer.chunks.text_scope) == []
    writer.chunks.record_texts([("Another chunk text that is long enough.", [1, 2])], [])
