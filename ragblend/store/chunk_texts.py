"""The chunk texts a store holds KV for, kept with the KV so every reader of the store knows them.

The content matcher (``ragblend.matching``) finds known chunk texts inside any prompt. A chunk
warmed by ``ragblend warmup``, by a server or by an integration's ingestion is recorded here,
beside its KV: in the disk tier (an SQLite file under the store's directory, owner-only) and in
Redis (a set of keys and an append-only list of texts under the store's prefix and namespace),
so every engine on that store can match it. Records are grouped by *scope* (model, dtypes,
namespace: ``ChunkCache.text_scope``), so one store shared by several models or tenants never
mixes their texts. Readers keep a cursor and read only what was added since their last read.

Like the KV itself this is a cache: a failed write or read is logged and is a miss (the text is
simply not known), never an error for the request.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from ragblend.private import private_dir, touch_private

log = logging.getLogger(__name__)

Record = tuple[str, str]  # (chunk key, chunk text)


class TextBackend(Protocol):
    """One place chunk texts are persisted."""

    def add(self, scope: str, records: Sequence[Record]) -> None:
        """Record texts by chunk key (a key already recorded in ``scope`` is ignored)."""
        ...

    def read(self, scope: str, cursor: int) -> tuple[list[str], int]:
        """Texts recorded in ``scope`` after ``cursor`` (0: all) and the cursor to pass next."""
        ...


class MemoryTexts:
    """Texts held in this process (a RAM-only store): shared by the engines on that store."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, set[str]] = {}
        self._log: dict[str, list[str]] = {}

    def add(self, scope: str, records: Sequence[Record]) -> None:
        with self._lock:
            seen = self._seen.setdefault(scope, set())
            texts = self._log.setdefault(scope, [])
            for key, text in records:
                if key not in seen:
                    seen.add(key)
                    texts.append(text)

    def read(self, scope: str, cursor: int) -> tuple[list[str], int]:
        with self._lock:
            texts = self._log.get(scope, [])
            return texts[cursor:], len(texts)


class SqliteTexts:
    """Texts in ``DIR/texts/chunk_texts.sqlite`` beside a disk tier (WAL: many processes)."""

    def __init__(self, store_dir: str | os.PathLike) -> None:
        self.path = Path(store_dir) / "texts" / "chunk_texts.sqlite"
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None

    def _connect(self) -> sqlite3.Connection:
        if self._conn is None:
            private_dir(self.path.parent, check=False)  # the store's root is checked
            touch_private(self.path)  # owner-only whatever the umask; SQLite's -wal/-shm follow
            conn = sqlite3.connect(self.path, timeout=10.0, check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute(
                "CREATE TABLE IF NOT EXISTS chunk_texts (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                "scope TEXT NOT NULL, key TEXT NOT NULL, text TEXT NOT NULL, UNIQUE(scope, key))"
            )
            conn.commit()
            self._conn = conn
        return self._conn

    def add(self, scope: str, records: Sequence[Record]) -> None:
        if not records:
            return
        try:
            with self._lock:
                conn = self._connect()
                with conn:
                    conn.executemany(
                        "INSERT OR IGNORE INTO chunk_texts (scope, key, text) VALUES (?, ?, ?)",
                        [(scope, key, text) for key, text in records],
                    )
        except (sqlite3.Error, OSError) as exc:
            log.warning("chunk texts at %s: cannot record them: %s", self.path, exc)

    def read(self, scope: str, cursor: int) -> tuple[list[str], int]:
        try:
            with self._lock:
                rows = (
                    self._connect()
                    .execute(
                        "SELECT id, text FROM chunk_texts WHERE scope = ? AND id > ? ORDER BY id",
                        (scope, cursor),
                    )
                    .fetchall()
                )
        except (sqlite3.Error, OSError) as exc:
            log.warning("chunk texts at %s are unreadable: %s", self.path, exc)
            return [], cursor
        return [text for _, text in rows], (rows[-1][0] if rows else cursor)


class RedisTexts:
    """Texts in the Redis tier: ``…:texts:{scope}:keys`` (a set) and ``…:texts:{scope}:log``
    (a list, appended to once per new key), under the store's prefix and namespace. On a Redis
    Cluster both names share one hash tag (``{…:texts:scope}:keys``), so they live on one
    shard and move together."""

    def __init__(self, store) -> None:
        self.store = store

    def _names(self, scope: str) -> tuple[str, str]:
        base = self.store.redis_key(f"texts:{scope}")
        if self.store.is_cluster():
            base = "{" + base + "}"
        return f"{base}:keys", f"{base}:log"

    def add(self, scope: str, records: Sequence[Record]) -> None:
        if not records:
            return
        keys_name, log_name = self._names(scope)

        def write(client) -> None:
            pipe = client.pipeline(transaction=False)
            for key, _ in records:
                pipe.sadd(keys_name, key)
            new = [text for (_, text), added in zip(records, pipe.execute()) if added]
            if new:
                client.rpush(log_name, *new)

        self._call(write, None, keys_name)

    def read(self, scope: str, cursor: int) -> tuple[list[str], int]:
        _, log_name = self._names(scope)

        def read(client) -> tuple[list[str], int]:
            length = int(client.llen(log_name))
            start = cursor if cursor <= length else 0  # the list was evicted: read it again
            texts = client.lrange(log_name, start, -1) if length > start else []
            return [t.decode("utf-8") for t in texts], start + len(texts)

        return self._call(read, ([], cursor), log_name)

    def _call(self, fn, default, name: str):
        from ragblend.store.redis_client import Unreachable

        try:
            return self.store._call(fn, name)  # the store's outage handling: once, back-off
        except Unreachable:
            return default
        except Exception as exc:  # a Redis error reply, bad bytes: the texts are a cache
            log.warning("chunk texts in %r: %s", self.store, exc)
            return default


_MEMORY: weakref.WeakKeyDictionary[object, MemoryTexts] = weakref.WeakKeyDictionary()
_MEMORY_LOCK = threading.Lock()


def backends_for(store: object) -> list[TextBackend]:
    """Where ``store`` keeps chunk texts: its disk directory and Redis server, through every
    tier of a layered store; a store with neither keeps them in this process."""
    from ragblend.store.disk import DiskStore
    from ragblend.store.redis import RedisStore

    tiers = list(getattr(store, "tiers", None) or [store])
    found: list[TextBackend] = []
    for tier in tiers:
        if isinstance(tier, DiskStore):
            found.append(SqliteTexts(tier.path))
        elif isinstance(tier, RedisStore):
            found.append(RedisTexts(tier))
    if found:
        return found
    with _MEMORY_LOCK:
        memory = _MEMORY.get(store)
        if memory is None:
            memory = _MEMORY[store] = MemoryTexts()
    return [memory]


class ChunkTexts:
    """A reader and writer of one store's chunk texts (all its backends), with its cursors."""

    def __init__(self, store: object) -> None:
        self.backends = backends_for(store)
        self._cursors: dict[tuple[int, str], int] = {}
        self._lock = threading.Lock()

    def add(self, scope: str, records: Sequence[Record]) -> None:
        """Record ``(chunk key, text)`` pairs in every backend."""
        for backend in self.backends:
            backend.add(scope, records)

    def new_texts(self, scope: str) -> list[str]:
        """Texts recorded in ``scope`` (by anyone) since this object's previous call."""
        out: list[str] = []
        with self._lock:
            for i, backend in enumerate(self.backends):
                cursor = self._cursors.get((i, scope), 0)
                texts, self._cursors[(i, scope)] = backend.read(scope, cursor)
                out += texts
        return out
