"""The disk tier's index: one SQLite row per entry file, LRU by an indexed stamp column.

The index knows entries (key → file, bytes, identity, last use), counters and the total size;
it knows nothing of entry-file contents. It is a cache of what the entry files' own headers
say, so a damaged index is never fatal: on ``sqlite3.DatabaseError`` (malformed file,
truncated, bad journal) the database is moved aside, rebuilt from the entry files through the
``rebuild`` callback (or started empty), logged once, and the operation is answered (retried
once, else its miss/no-op default). Process-safe through SQLite's WAL mode and busy timeout.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypeVar

from ragblend.private import private_dir, touch_private

log = logging.getLogger(__name__)

T = TypeVar("T")
COUNTERS = ("hits", "misses", "puts", "evictions")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY, file TEXT NOT NULL, bytes INTEGER NOT NULL, stamp INTEGER NOT NULL,
    version INTEGER NOT NULL, fingerprint TEXT NOT NULL, dtype TEXT NOT NULL,
    kv_dtype TEXT NOT NULL, context TEXT NOT NULL, tokens INTEGER NOT NULL,
    created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS entries_by_stamp ON entries (stamp);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""
_COLUMNS = "key, file, bytes, version, fingerprint, dtype, kv_dtype, context, tokens, created"


@dataclass(frozen=True)
class IndexEntry:
    """One indexed entry file (``file`` relative to the store's data directory)."""

    key: str
    file: str
    bytes: int
    version: int
    fingerprint: str
    dtype: str
    kv_dtype: str
    context: str
    tokens: int
    created: float

    def as_dict(self) -> dict:
        return asdict(self)


class DiskIndex:
    """SQLite index under ``directory`` (``index.db`` and its WAL)."""

    def __init__(
        self, directory: Path, rebuild: Callable[[], Iterable[IndexEntry]] | None = None
    ) -> None:
        self.directory = Path(directory)
        private_dir(self.directory, check=False)
        self.path = self.directory / "index.db"
        self._rebuild = rebuild
        self._lock = threading.RLock()
        self._con: sqlite3.Connection | None = None
        self.recoveries = 0
        self._run(lambda con: None, None)  # open (and recover) now, not at the first query

    # ------------------------------------------------------------------ connection
    def _connect(self) -> sqlite3.Connection:
        touch_private(self.path)  # SQLite gives its -wal and -shm files the database's mode
        con = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
        try:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=NORMAL")
            check = con.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {check}")
            fresh = (
                con.execute(
                    "SELECT 1 FROM sqlite_master WHERE type='table' AND name='entries'"
                ).fetchone()
                is None
            )
            con.executescript(_SCHEMA)
            con.execute("SELECT key FROM entries ORDER BY stamp LIMIT 1").fetchall()
        except BaseException:
            con.close()
            raise
        if fresh and self._rebuild is not None:
            self._insert_rebuilt(con)
        return con

    def _run(self, op: Callable[[sqlite3.Connection], T], default: T) -> T:
        """``op(connection)``, recovering a damaged database once; ``default`` if it fails."""
        with self._lock:
            for attempt in range(2):
                try:
                    if self._con is None:
                        self._con = self._connect()
                    return op(self._con)
                except sqlite3.OperationalError as exc:
                    if "locked" in str(exc) or "busy" in str(exc):
                        log.warning("KV index %s is busy (%s): treated as a miss", self.path, exc)
                        return default
                    if attempt:
                        break
                    self._recover(exc)
                except sqlite3.DatabaseError as exc:
                    if attempt:
                        break
                    self._recover(exc)
            log.warning("KV index %s is unusable: treated as a miss", self.path)
            return default

    def _recover(self, exc: Exception) -> None:
        """Move the damaged database aside and start over (rebuilt from the entry files)."""
        self.recoveries += 1
        if self._con is not None:
            try:
                self._con.close()
            except sqlite3.Error:
                pass
            self._con = None
        aside = self.directory.parent / f"{self.directory.name}.corrupt-{time.time_ns()}"
        private_dir(aside, check=False)
        for suffix in ("", "-wal", "-shm", "-journal"):
            src = self.path.with_name(self.path.name + suffix)
            try:
                src.replace(aside / src.name)
            except OSError:
                pass
        log.warning(
            "KV index %s is damaged (%s): moved to %s and rebuilt from the entry files",
            self.path,
            exc,
            aside,
        )

    def rebuild(self) -> int:
        """Move the index aside and rebuild it from the entry files; returns the entry count."""
        with self._lock:
            self._recover(RuntimeError("rebuild requested"))
        return self._run(lambda con: len(self._keys(con)), 0)

    def _insert_rebuilt(self, con: sqlite3.Connection) -> None:
        assert self._rebuild is not None
        now = time.time_ns()
        with _transaction(con):
            for n, entry in enumerate(self._rebuild()):
                con.execute(
                    f"INSERT OR IGNORE INTO entries ({_COLUMNS}, stamp) VALUES "
                    "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (*_row(entry), now + n),
                )
            _set_bytes(con)

    # ------------------------------------------------------------------ entries
    def get(self, key: str) -> IndexEntry | None:
        """The entry's row, or None; a malformed row is deleted (its file becomes an orphan
        that ``gc`` collects) and is a miss."""

        def op(con):
            row = con.execute(f"SELECT {_COLUMNS} FROM entries WHERE key=?", (key,)).fetchone()
            if row is None:
                return None
            entry = _entry_of(row)
            if entry is None:
                log.warning("KV index %s: malformed row for %s… dropped", self.path, key[:16])
                with _transaction(con):
                    con.execute("DELETE FROM entries WHERE key=?", (key,))
                    _set_bytes(con)
            return entry

        return self._run(op, None)

    def __contains__(self, key: str) -> bool:
        return self._run(
            lambda con: (
                con.execute("SELECT 1 FROM entries WHERE key=?", (key,)).fetchone() is not None
            ),
            False,
        )

    def keys(self) -> list[str]:
        return self._run(self._keys, [])

    @staticmethod
    def _keys(con: sqlite3.Connection) -> list[str]:
        return [k for (k,) in con.execute("SELECT key FROM entries ORDER BY rowid")]

    def lru(self, limit: int = -1) -> list[IndexEntry]:
        """Entries, least recently used first (one indexed query)."""
        return self._run(
            lambda con: [
                entry
                for row in con.execute(
                    f"SELECT {_COLUMNS} FROM entries ORDER BY stamp LIMIT ?", (limit,)
                )
                if (entry := _entry_of(row)) is not None
            ],
            [],
        )

    def add(self, entry: IndexEntry) -> bool:
        """Index a new entry file; False when the key is indexed already (keep that one)."""

        def op(con):
            with _transaction(con):
                cur = con.execute(
                    f"INSERT OR IGNORE INTO entries ({_COLUMNS}, stamp) VALUES "
                    "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (*_row(entry), time.time_ns()),
                )
                if cur.rowcount != 1:
                    return False
                self._add_bytes(con, entry.bytes)
                return True

        return self._run(op, False)

    def _add_bytes(self, con: sqlite3.Connection, delta: int) -> None:
        """Inside ``add``'s transaction (a process killed here leaves the row unwritten)."""
        _incr(con, "bytes", delta)

    def touch(self, key: str) -> None:
        """Mark ``key`` as just used."""
        self._run(
            lambda con: con.execute(
                "UPDATE entries SET stamp=? WHERE key=?", (time.time_ns(), key)
            ),
            None,
        )

    def remove(self, key: str, file: str | None = None) -> IndexEntry | None:
        """Forget ``key`` (only if it still names ``file``, when given); returns what it was."""

        def op(con):
            with _transaction(con):
                row = con.execute(f"SELECT {_COLUMNS} FROM entries WHERE key=?", (key,)).fetchone()
                if row is None or (file is not None and row[1] != file):
                    return None
                con.execute("DELETE FROM entries WHERE key=?", (key,))
                entry = _entry_of(row)
                if entry is None:
                    _set_bytes(con)
                else:
                    _incr(con, "bytes", -entry.bytes)
                return entry

        return self._run(op, None)

    # ------------------------------------------------------------------ counters
    @property
    def nbytes(self) -> int:
        """Total size of the indexed entry files."""
        return self._run(lambda con: _counter(con, "bytes"), 0)

    def count(self, name: str) -> None:
        self._run(lambda con: _incr(con, name, 1), None)

    def counters(self) -> dict[str, int]:
        return self._run(
            lambda con: {n: _counter(con, n) for n in COUNTERS}, dict.fromkeys(COUNTERS, 0)
        )

    def recount_bytes(self) -> int:
        """Set the byte total to the sum over the rows (exact after crashes); returns it."""

        def op(con):
            with _transaction(con):
                return _set_bytes(con)

        return self._run(op, 0)

    def close(self) -> None:
        with self._lock:
            if self._con is not None:
                try:
                    self._con.close()
                except sqlite3.Error:
                    pass
                self._con = None


class _transaction:
    """``BEGIN IMMEDIATE`` … ``COMMIT`` (``ROLLBACK`` on error) on an autocommit connection."""

    def __init__(self, con: sqlite3.Connection) -> None:
        self.con = con

    def __enter__(self) -> sqlite3.Connection:
        self.con.execute("BEGIN IMMEDIATE")
        return self.con

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.con.execute("COMMIT")
        elif self.con.in_transaction:
            try:
                self.con.execute("ROLLBACK")
            except sqlite3.Error:
                pass


_TYPES: tuple = (str, str, int, int, str, str, str, str, int, (int, float))


def _entry_of(row: tuple) -> IndexEntry | None:
    """The row as an ``IndexEntry``, or None when any field has the wrong type or no file."""
    if len(row) != len(_TYPES) or not row[1]:
        return None
    if any(not isinstance(value, t) for value, t in zip(row, _TYPES)):
        return None
    return IndexEntry(*row)


def _row(e: IndexEntry) -> tuple:
    return (
        e.key,
        e.file,
        e.bytes,
        e.version,
        e.fingerprint,
        e.dtype,
        e.kv_dtype,
        e.context,
        e.tokens,
        e.created,
    )


def _counter(con: sqlite3.Connection, name: str) -> int:
    row = con.execute("SELECT value FROM counters WHERE name=?", (name,)).fetchone()
    return 0 if row is None else int(row[0])


def _incr(con: sqlite3.Connection, name: str, delta: int) -> None:
    con.execute(
        "INSERT INTO counters (name, value) VALUES (?, ?) "
        "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
        (name, delta),
    )


def _set_bytes(con: sqlite3.Connection) -> int:
    (total,) = con.execute("SELECT COALESCE(SUM(bytes), 0) FROM entries").fetchone()
    con.execute(
        "INSERT INTO counters (name, value) VALUES ('bytes', ?) "
        "ON CONFLICT(name) DO UPDATE SET value = excluded.value",
        (int(total),),
    )
    return int(total)
