"""Disk tier: one entry file per chunk (``store.codec``) under an SQLite index (``store.index``).

Layout under the store's directory::

    index/index.db             the index (entries, LRU stamps, byte and hit counters)
    data/ab/<key>.<rand>.safetensors   one entry file each (see ``ragblend.store.codec``)
    tmp/                       files being written (renamed into data/ once durable)

Integrity rules: a file is written to ``tmp/``, fsynced, renamed into ``data/`` and only then
indexed (an index row never names a half-written file). Anything that does not verify
(missing, truncated, foreign, other format version, checksum mismatch) is a miss: logged once
and dropped, never returned. A damaged index is moved aside and rebuilt from the entry files'
headers (``DiskIndex``); ``rebuild_index()`` does it on demand.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ragblend.errors import CorruptEntryError
from ragblend.private import private_dir
from ragblend.store import codec, files
from ragblend.store.base import KVEntry, StoreStats
from ragblend.store.codec import EntryHeader, EntryInvalid, checksum_algorithm
from ragblend.store.disk_entry import DiskChunkKV
from ragblend.store.index import DiskIndex, IndexEntry

log = logging.getLogger(__name__)

FORMAT_VERSION = codec.FORMAT_VERSION
DEFAULT_DISK_BYTES = 32 << 30
__all__ = ["DEFAULT_DISK_BYTES", "DiskChunkKV", "DiskStore", "checksum_algorithm"]


def default_store_path() -> Path:
    """``ragblend_home()/kv``."""
    from ragblend.paths import kv_dir

    return kv_dir()


class DiskStore:
    """Byte-bounded LRU of chunk KV files; safe to share between threads and processes.

    ``capacity_bytes`` bounds the entry files' total size (the index adds a little on top).
    Set ``fsync=False`` only for throwaway stores (tests, benchmarks): writes stay atomic
    against crashes of the process, not of the machine.
    """

    tier = "disk"
    prefetch_depth = 2

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        capacity_bytes: int = DEFAULT_DISK_BYTES,
        fsync: bool = True,
    ) -> None:
        self.path = Path(path) if path is not None else default_store_path()
        self.capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        self.data_dir = self.path / "data"
        self.tmp_dir = self.path / "tmp"
        private_dir(self.path)  # warns once if others can read an existing store
        for d in (self.data_dir, self.tmp_dir):
            private_dir(d, check=False)
        self.stats = StoreStats()
        self.write_errors = 0
        self.last_write_error: str | None = None
        self.bytes_written = 0
        self._warned: set[tuple[str, str]] = set()
        self._warn_lock = threading.Lock()
        self.index = DiskIndex(
            self.path / "index", rebuild=lambda: files.scan_entry_files(self.data_dir)
        )

    # ------------------------------------------------------------------ index views
    def _entry(self, key: str) -> dict | None:
        entry = self.index.get(key)
        return None if entry is None else entry.as_dict()

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def __len__(self) -> int:
        return len(self.index.keys())

    def keys(self) -> Iterator[str]:
        yield from self.index.keys()

    @property
    def nbytes(self) -> int:
        """Total size of the entry files (as recorded in the index)."""
        return self.index.nbytes

    def counters(self) -> dict:
        """Hit/miss/put/eviction counters of every process that used this store."""
        return self.index.counters()

    def _count(self, name: str) -> None:
        self.stats.count(name)
        self.index.count(name)

    def _warn_once(self, key: str, reason: str) -> None:
        with self._warn_lock:
            first = (key, reason) not in self._warned
            self._warned.add((key, reason))
        (log.warning if first else log.debug)(
            "KV store %s: entry %s… is a miss: %s", self.path, key[:16], reason
        )

    # ------------------------------------------------------------------ read
    def get(self, key: str) -> DiskChunkKV | None:
        """A lazily read entry, or None (misses include entries that fail verification)."""
        entry = self.index.get(key)
        if entry is None:
            self._count("misses")
            return None
        path = self.data_dir / entry.file
        try:
            opened = self._open(key, entry)
        except (EntryInvalid, OSError) as exc:
            self._drop(key, path, f"{getattr(exc, 'kind', 'unreadable')}: {exc}")
            self._count("misses")
            return None
        if opened is None:  # evicted or rewritten meanwhile: a plain miss
            self._count("misses")
            return None
        fd, header = opened
        self.index.touch(key)
        self._count("hits")
        return DiskChunkKV(key, path, fd, header, lambda reason: self._drop(key, path, reason))

    def _open(self, key: str, entry: IndexEntry) -> tuple[int, EntryHeader] | None:
        """Open and check the file ``entry`` names; None when it vanished with its row."""
        if entry.version != FORMAT_VERSION:
            raise EntryInvalid(f"index entry of format v{entry.version}", "foreign")
        try:
            fd = os.open(self.data_dir / entry.file, os.O_RDONLY)
        except FileNotFoundError:
            if self.index.get(key) != entry:
                return None
            raise EntryInvalid("data file is missing") from None
        try:
            header = codec.read_header(fd, key)
            for field in ("fingerprint", "dtype", "kv_dtype", "context"):
                if header.meta.get(field) != getattr(entry, field):
                    raise EntryInvalid(f"{field} differs from the index entry", "foreign")
        except BaseException:
            os.close(fd)
            raise
        return fd, header

    def _drop(self, key: str, path: Path, reason: str | None) -> None:
        """Forget ``key`` if its index entry still names ``path``, and delete the file.

        ``reason`` (logged once per key and reason) is None for a deliberate removal.
        """
        if reason is not None:
            self._warn_once(key, reason)
        entry = self.index.get(key)
        if entry is not None and self.data_dir / entry.file != path:
            return  # the key was re-written meanwhile; leave the new file alone
        self.index.remove(key, path.relative_to(self.data_dir).as_posix())
        files.unlink(path)

    def discard(self, key: str) -> None:
        """Remove an entry (no-op when absent)."""
        entry = self.index.get(key)
        if entry is not None:
            self._drop(key, self.data_dir / entry.file, None)

    # ------------------------------------------------------------------ write
    def put(self, key: str, kv: KVEntry) -> None:
        """Store ``kv`` (no-op when ``key`` is stored); write errors are logged, never raised."""
        if key in self:
            return
        if kv.nbytes > self.capacity_bytes:
            log.warning(
                "KV entry of %d bytes exceeds the disk tier (%d)", kv.nbytes, self.capacity_bytes
            )
            return
        name = f"{key[:2]}/{key}.{uuid.uuid4().hex[:12]}.safetensors"
        final = self.data_dir / name
        tmp = self.tmp_dir / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            size = self._write(tmp, key, kv)
            private_dir(final.parent, check=False)
            os.replace(tmp, final)
            if self.fsync:
                files.fsync_dir(final.parent)
        except OSError as exc:
            files.unlink(tmp)
            self._write_failed(key, exc)
            return
        ident = codec.identity(kv)
        entry = IndexEntry(
            key=key,
            file=name,
            bytes=size,
            version=FORMAT_VERSION,
            tokens=kv.num_tokens,
            created=time.time(),
            **ident,
        )
        if not self.index.add(entry):
            files.unlink(final)  # another process won the race (or the index is unusable)
            return
        self.bytes_written += size
        self._count("puts")
        self._evict(keep=key)

    def _write(self, tmp: Path, key: str, kv: KVEntry) -> int:
        """Write the entry file durably to ``tmp``; returns its size."""
        return codec.write_entry(tmp, key, kv, self.fsync)

    def _write_failed(self, key: str, exc: OSError) -> None:
        self.write_errors += 1
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        self.last_write_error = "disk full" if full else str(exc)
        first = self.write_errors == 1
        (log.warning if first else log.debug)(
            "KV store %s: could not write entry %s… (%s); the chunk stays a miss",
            self.path,
            key[:16],
            "disk full" if full else exc,
        )

    # ------------------------------------------------------------------ eviction
    def _evict(self, keep: str | None = None, capacity: int | None = None) -> int:
        """Evict least recently used entries until the files fit ``capacity``."""
        capacity = self.capacity_bytes if capacity is None else capacity
        evicted = 0
        while self.nbytes > capacity:
            victims = [e for e in self.index.lru(limit=16) if e.key != keep]
            if not victims:
                break
            for entry in victims:
                if self.nbytes <= capacity:
                    break
                if self.index.remove(entry.key, entry.file) is not None:
                    files.unlink(self.data_dir / entry.file)
                    self._count("evictions")
                    evicted += 1
        return evicted

    def lru_keys(self) -> list[str]:
        """Stored keys, least recently used first."""
        return [e.key for e in self.index.lru()]

    # ------------------------------------------------------------------ maintenance
    def verify(self, drop: bool = False) -> dict:
        """Read every entry and check it; ``drop`` removes the bad ones.

        Returns counts: ``ok``, ``corrupt`` (checksum/truncation/missing file), ``foreign``
        (other format or metadata mismatch) and ``errors`` (a list of (key, reason)).
        """
        report: dict = {"ok": 0, "corrupt": 0, "foreign": 0, "errors": []}
        for key in list(self.keys()):
            entry = self.index.get(key)
            if entry is None:
                continue
            status, reason = self._check(key, entry)
            if status == "gone":
                continue
            report[status] += 1
            if status != "ok":
                report["errors"].append((key, reason))
                if drop:
                    self._drop(key, self.data_dir / entry.file, reason)
        return report

    def _check(self, key: str, entry: IndexEntry) -> tuple[str, str]:
        try:
            opened = self._open(key, entry)
        except EntryInvalid as exc:
            return exc.kind, str(exc)
        except OSError as exc:
            return "corrupt", f"data file unreadable ({exc.strerror})"
        if opened is None:
            return "gone", ""
        fd, header = opened
        entry_kv = DiskChunkKV(key, self.data_dir / entry.file, fd, header)
        try:
            for i in range(entry_kv.num_layers):
                entry_kv.stored_layer(i)
        except CorruptEntryError as exc:
            return "corrupt", exc.reason
        finally:
            entry_kv.close()
        return "ok", ""

    def rebuild_index(self) -> int:
        """Move the index aside and rebuild it from the entry files; returns the entry count."""
        return self.index.rebuild()

    def gc(self, grace_s: float = 3600.0) -> dict:
        """Drop bad entries, orphan and stale temp files, and evict down to capacity.

        Files younger than ``grace_s`` seconds are left alone (a writer may be about to
        rename or index them).
        """
        report = self.verify(drop=True)
        referenced = {e.file for e in self.index.lru()}
        orphans = files.remove_old(files.entry_files(self.data_dir), grace_s, keep=referenced)
        stale = files.remove_old(self.tmp_dir.glob("*.tmp"), grace_s)
        self.index.recount_bytes()
        evicted = self._evict()
        return {**report, "orphans": orphans, "stale_tmp": stale, "evicted": evicted}

    def drop_page_cache(self) -> bool:
        """Ask the OS to drop this store's files from the page cache (for cold reads); False
        where ``posix_fadvise`` is unsupported (then reads may stay warm)."""
        return files.drop_page_cache(files.entry_files(self.data_dir))

    def disk_usage(self) -> dict:
        """Bytes of entry files, index and temp files actually on disk."""
        return {
            "data": files.total_size(files.entry_files(self.data_dir)),
            "index": files.total_size((self.path / "index").glob("*")),
            "tmp": files.total_size(self.tmp_dir.glob("*")),
        }

    def close(self) -> None:
        self.index.close()

    def __repr__(self) -> str:
        return f"DiskStore({str(self.path)!r}, capacity_bytes={self.capacity_bytes})"
