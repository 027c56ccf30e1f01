"""Disk tier: chunk KV entries as safetensors files, indexed by a process-safe diskcache.

Layout under the store's directory::

    index/                     diskcache (SQLite): entry metadata, LRU clock, byte and hit counters
    data/ab/<key>.<rand>.safetensors   one file per entry: k.0, v.0, k.1, v.1, … in that order
    tmp/                       files being written (renamed into data/ once durable)

Each file is a valid safetensors file (readable with ``safetensors.safe_open``) whose header
metadata records the format version, the key, model fingerprint, dtype, precompute context hash,
token count and one checksum per layer. Layer ``i``'s K and V are adjacent, so one layer is read
with a single positional read, without touching the others, and verified when read.

Integrity rules: a file is written to ``tmp/``, fsynced, renamed into ``data/`` and only then
entered in the index (so an index entry never points at a half-written file). Anything that does
not verify (missing, truncated, foreign, other format version, checksum mismatch) is a miss: it
is logged once and dropped, never returned.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ragblend.errors import CorruptEntryError
from ragblend.store.base import ChunkKV, StoreStats

try:  # xxh3 is ~10x faster than blake2b; blake2b (stdlib) is the fallback
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

log = logging.getLogger(__name__)

FORMAT = "ragblend-kv"
FORMAT_VERSION = 1
DEFAULT_DISK_BYTES = 32 << 30
_MAX_HEADER = 16 << 20
_ENTRY = "e:"  # index key prefix: entry metadata (JSON text)
_STAMP = "a:"  # index key prefix: LRU stamp (int, from the shared clock)
_CLOCK, _BYTES = "__clock__", "__bytes__"
_COUNTERS = ("hits", "misses", "puts", "evictions")

_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


def default_store_path() -> Path:
    """``ragblend_home()/kv``."""
    from ragblend.paths import kv_dir

    return kv_dir()


def checksum_algorithm() -> str:
    return "xxh3_64" if xxhash is not None else "blake2b_64"


def _hasher(algorithm: str):
    if algorithm == "xxh3_64" and xxhash is not None:
        return xxhash.xxh3_64()
    if algorithm == "blake2b_64":
        return hashlib.blake2b(digest_size=8)
    return None


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class EntryInvalid(Exception):
    """Why an entry cannot be used (internal: turned into a miss).

    ``kind`` is ``"corrupt"`` (damaged, truncated, missing) or ``"foreign"`` (written by another
    format version, model or dtype than its index entry says).
    """

    def __init__(self, reason: str, kind: str = "corrupt") -> None:
        super().__init__(reason)
        self.kind = kind


@dataclass
class _Header:
    """The parsed safetensors header of an entry file."""

    meta: dict  # the ragblend metadata (strings decoded)
    data_start: int  # file offset of the data buffer
    offsets: dict[str, tuple[int, int]]  # tensor name -> [begin, end) within the data buffer
    shape: tuple[int, int, int]  # per-layer [kv_heads, tokens, head_dim]
    dtype: torch.dtype
    file_size: int


def _build_header(key: str, kv: ChunkKV, checksums: list[str], algorithm: str) -> bytes:
    layers, heads, tokens, dim = kv.k.shape
    dtype = _ST_DTYPES.get(kv.k.dtype)
    if dtype is None:
        raise ValueError(f"cannot store dtype {kv.k.dtype}")
    per = heads * tokens * dim * kv.k.element_size()
    header: dict = {}
    offset = 0
    for i in range(layers):
        for name in ("k", "v"):
            header[f"{name}.{i}"] = {
                "dtype": dtype,
                "shape": [heads, tokens, dim],
                "data_offsets": [offset, offset + per],
            }
            offset += per
    user = {k: v for k, v in kv.meta.items() if isinstance(v, (str, int, float, bool))}
    header["__metadata__"] = {
        "format": FORMAT,
        "version": str(FORMAT_VERSION),
        "key": key,
        "fingerprint": str(kv.meta.get("fingerprint", "")),
        "dtype": str(kv.k.dtype),
        "context": str(kv.meta.get("context", "")),
        "tokens": str(tokens),
        "layers": str(layers),
        "checksum": algorithm,
        "checksums": json.dumps(checksums),
        "meta": json.dumps(user, sort_keys=True),
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # safetensors aligns the data buffer to 8 bytes
    return struct.pack("<Q", len(raw)) + raw


def _read_header(fd: int, key: str | None) -> _Header:
    """Parse and check an entry file's header; raises EntryInvalid when it is not usable."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) < 8:
        raise EntryInvalid("truncated (no header)")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
        raise EntryInvalid("truncated or corrupt header")
    try:
        header = json.loads(os.pread(fd, n, 8))
        meta = header.pop("__metadata__")
    except (ValueError, KeyError) as exc:
        raise EntryInvalid(f"corrupt header ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("version") != str(FORMAT_VERSION):
        raise EntryInvalid(
            f"format {meta.get('format')} v{meta.get('version')} is not ours", "foreign"
        )
    if key is not None and meta.get("key") != key:
        raise EntryInvalid("file belongs to another key", "foreign")
    if _hasher(str(meta.get("checksum"))) is None:
        raise EntryInvalid(f"checksum {meta.get('checksum')} is unavailable here", "foreign")
    try:
        layers = int(meta["layers"])
        tokens = int(meta["tokens"])
        checksums = json.loads(meta["checksums"])
        offsets, shape, dtype, end = {}, None, None, 0
        for i in range(layers):
            for name in ("k", "v"):
                info = header[f"{name}.{i}"]
                begin, stop = info["data_offsets"]
                if begin != end:
                    raise EntryInvalid("tensors out of order")
                end = stop
                offsets[f"{name}.{i}"] = (begin, stop)
                shape = shape or tuple(info["shape"])
                dtype = dtype or _TORCH_DTYPES[info["dtype"]]
                if tuple(info["shape"]) != shape or _TORCH_DTYPES[info["dtype"]] != dtype:
                    raise EntryInvalid("tensor shapes or dtypes differ")
    except (KeyError, ValueError, TypeError) as exc:
        raise EntryInvalid(f"incomplete header ({exc!r})") from None
    if shape is None or len(shape) != 3 or shape[1] != tokens or len(checksums) != layers:
        raise EntryInvalid("header does not match its metadata")
    if str(dtype) != meta.get("dtype"):
        raise EntryInvalid(f"dtype {meta.get('dtype')} does not match the tensors ({dtype})",
                           "foreign")
    if 8 + n + end != size:
        raise EntryInvalid(f"truncated ({size} bytes, expected {8 + n + end})")
    meta["checksums"] = checksums
    return _Header(meta, 8 + n, offsets, shape, dtype, size)


class DiskChunkKV:
    """A disk entry with the ChunkKV interface; each layer is read (and verified) on demand.

    The file stays open while the object lives, so an entry evicted meanwhile still reads.
    """

    def __init__(self, store: DiskStore | None, key: str, path: Path, fd: int, header: _Header):
        self._store = store
        self.key = key
        self.path = path
        self._fd = fd
        self._header = header
        self._lock = threading.Lock()
        self._full: ChunkKV | None = None
        user = json.loads(header.meta.get("meta") or "{}")
        self.meta = {**user, "fingerprint": header.meta["fingerprint"],
                     "dtype": header.meta["dtype"], "tokens": self.num_tokens,
                     "context": header.meta.get("context", ""), "tier": "disk"}

    @property
    def num_tokens(self) -> int:
        return int(self._header.shape[1])

    @property
    def num_layers(self) -> int:
        return len(self._header.meta["checksums"])

    @property
    def dtype(self) -> torch.dtype:
        return self._header.dtype

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        return self._header.shape

    @property
    def nbytes(self) -> int:
        begin = self._header.offsets["k.0"][0]
        end = self._header.offsets[f"v.{self.num_layers - 1}"][1]
        return end - begin

    def read_layer_into(self, index: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Read layer ``index`` into contiguous CPU tensors; CorruptEntryError on mismatch."""
        if not 0 <= index < self.num_layers:
            raise IndexError(f"layer {index} out of range ({self.num_layers} layers)")
        kb, ke = self._header.offsets[f"k.{index}"]
        vb, ve = self._header.offsets[f"v.{index}"]
        k_view, v_view = _bytes_view(k_out), _bytes_view(v_out)
        if len(k_view) != ke - kb or len(v_view) != ve - vb:
            raise ValueError("output tensors do not match the entry's layer shape")
        start = self._header.data_start + kb
        try:
            if hasattr(os, "preadv"):
                got = os.preadv(self._fd, [k_view, v_view], start)
            else:  # pragma: no cover - platforms without preadv
                with self._lock:
                    os.lseek(self._fd, start, os.SEEK_SET)
                    got = os.readv(self._fd, [k_view, v_view])
        except OSError as exc:
            self._fail(f"read error ({exc})")
        if got != (ke - kb) + (ve - vb):
            self._fail(f"short read of layer {index}")
        hasher = _hasher(self._header.meta["checksum"])
        hasher.update(k_view)
        hasher.update(v_view)
        if hasher.hexdigest() != self._header.meta["checksums"][index]:
            self._fail(f"checksum mismatch in layer {index}")

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, [kv_heads, tokens, head_dim] (fresh CPU tensors)."""
        if self._full is not None:
            return self._full.layer(index)
        k = torch.empty(self._header.shape, dtype=self.dtype)
        v = torch.empty_like(k)
        self.read_layer_into(index, k, v)
        return k, v

    def materialize(self) -> ChunkKV:
        """Read every layer into one in-memory ChunkKV (cached on this object)."""
        if self._full is None:
            k = torch.empty((self.num_layers, *self._header.shape), dtype=self.dtype)
            v = torch.empty_like(k)
            for i in range(self.num_layers):
                self.read_layer_into(i, k[i], v[i])
            self._full = ChunkKV(k=k, v=v, meta=dict(self.meta))
        return self._full

    @property
    def k(self) -> torch.Tensor:
        return self.materialize().k

    @property
    def v(self) -> torch.Tensor:
        return self.materialize().v

    def _fail(self, reason: str):
        if self._store is not None:
            self._store._drop(self.key, self.path, reason)
        raise CorruptEntryError(self.key, reason)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()


class DiskStore:
    """Byte-bounded LRU of chunk KV files; safe to share between threads and processes.

    ``capacity_bytes`` bounds the entry files' total size (the index adds a little on top).
    Set ``fsync=False`` only for throwaway stores (tests, benchmarks): writes stay atomic
    against crashes of the process, not of the machine.
    """

    tier = "disk"
    tier = "disk"
    prefetch_depth = 2

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        capacity_bytes: int = DEFAULT_DISK_BYTES,
        fsync: bool = True,
    ) -> None:
        import diskcache

        self.path = Path(path) if path is not None else default_store_path()
        self.capacity_bytes = int(capacity_bytes)
        self.fsync = fsync
        self.data_dir = self.path / "data"
        self.tmp_dir = self.path / "tmp"
        for d in (self.data_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.index = diskcache.Cache(
            str(self.path / "index"),
            eviction_policy="none",
            size_limit=2**62,
            cull_limit=0,
            statistics=False,
        )
        self.stats = StoreStats()
        self.write_errors = 0
        self.last_write_error: str | None = None
        self.bytes_written = 0
        self._warned: set[tuple[str, str]] = set()
        self._warn_lock = threading.Lock()

    # ------------------------------------------------------------------ index helpers
    def _entry(self, key: str) -> dict | None:
        raw = self.index.get(_ENTRY + key, retry=True)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {"file": None, "bytes": 0}

    def __contains__(self, key: str) -> bool:
        return (_ENTRY + key) in self.index

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def keys(self) -> Iterator[str]:
        for k in self.index.iterkeys():
            if isinstance(k, str) and k.startswith(_ENTRY):
                yield k[len(_ENTRY) :]

    @property
    def nbytes(self) -> int:
        """Total size of the entry files (as recorded in the index)."""
        return int(self.index.get(_BYTES, 0, retry=True))

    def counters(self) -> dict:
        """Hit/miss/put/eviction counters of every process that used this store."""
        return {name: int(self.index.get(f"__{name}__", 0, retry=True)) for name in _COUNTERS}

    def _count(self, name: str) -> None:
        self.stats.count(name)
        self.index.incr(f"__{name}__", retry=True)

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
        entry = self._entry(key)
        if entry is None:
            self._count("misses")
            return None
        path = self.data_dir / str(entry.get("file"))
        try:
            if entry.get("version") != FORMAT_VERSION or not entry.get("file"):
                raise EntryInvalid(f"index entry of format v{entry.get('version')}", "foreign")
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                if self._entry(key) != entry:  # evicted or rewritten meanwhile: a plain miss
                    self._count("misses")
                    return None
                raise EntryInvalid("data file is missing") from None
            try:
                header = _read_header(fd, key)
                _check_matches(header, entry)
            except BaseException:
                os.close(fd)
                raise
        except (EntryInvalid, OSError) as exc:
            self._drop(key, path, f"{getattr(exc, 'kind', 'unreadable')}: {exc}")
            self._count("misses")
            return None
        with self.index.transact(retry=True):
            if (_ENTRY + key) in self.index:
                self.index.set(_STAMP + key, self.index.incr(_CLOCK), retry=True)
        self._count("hits")
        return DiskChunkKV(self, key, path, fd, header)

    def _drop(self, key: str, path: Path, reason: str | None) -> None:
        """Forget ``key`` if its index entry still points at ``path``, and delete the file.

        ``reason`` (logged once per key and reason) is None for a deliberate removal.
        """
        if reason is not None:
            self._warn_once(key, reason)
        with self.index.transact(retry=True):
            entry = self._entry(key)
            if entry is not None and self.data_dir / str(entry.get("file")) == path:
                self.index.delete(_ENTRY + key, retry=True)
                self.index.delete(_STAMP + key, retry=True)
                self.index.incr(_BYTES, -int(entry.get("bytes", 0)), retry=True)
            elif entry is not None:
                return  # the key was re-written meanwhile; leave the new file alone
        _unlink(path)

    def discard(self, key: str) -> None:
        """Remove an entry (no-op when absent)."""
        entry = self._entry(key)
        if entry is not None:
            self._drop(key, self.data_dir / str(entry.get("file")), None)

    # ------------------------------------------------------------------ write
    def put(self, key: str, kv: ChunkKV) -> None:
        """Store ``kv`` (no-op when ``key`` is stored); write errors are logged, never raised."""
        if key in self:
            return
        if isinstance(kv, DiskChunkKV):
            kv = kv.materialize()
        size_hint = kv.nbytes
        if size_hint > self.capacity_bytes:
            log.warning("KV entry of %d bytes exceeds the disk tier (%d)", size_hint,
                        self.capacity_bytes)
            return
        name = f"{key[:2]}/{key}.{uuid.uuid4().hex[:12]}.safetensors"
        final = self.data_dir / name
        tmp = self.tmp_dir / f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            size = self._write(tmp, key, kv)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
            if self.fsync:
                _fsync_dir(final.parent)
        except OSError as exc:
            _unlink(tmp)
            self._write_failed(key, exc)
            return
        entry = {
            "file": name,
            "bytes": size,
            "version": FORMAT_VERSION,
            "fingerprint": str(kv.meta.get("fingerprint", "")),
            "dtype": str(kv.k.dtype),
            "context": str(kv.meta.get("context", "")),
            "tokens": kv.num_tokens,
            "created": time.time(),
        }
        with self.index.transact(retry=True):
            if (_ENTRY + key) in self.index:
                stored = False  # another process won the race: keep its file
            else:
                self.index.set(_ENTRY + key, json.dumps(entry), retry=True)
                self.index.set(_STAMP + key, self.index.incr(_CLOCK), retry=True)
                self.index.incr(_BYTES, size, retry=True)
                stored = True
        if not stored:
            _unlink(final)
            return
        self.bytes_written += size
        self._count("puts")
        self._evict(keep=key)

    def _write(self, tmp: Path, key: str, kv: ChunkKV) -> int:
        """Write the entry file durably to ``tmp``; returns its size."""
        k = kv.k.detach().to("cpu").contiguous()
        v = kv.v.detach().to("cpu").contiguous()
        algorithm = checksum_algorithm()
        checksums = []
        for i in range(k.shape[0]):
            h = _hasher(algorithm)
            h.update(_bytes_view(k[i]))
            h.update(_bytes_view(v[i]))
            checksums.append(h.hexdigest())
        header = _build_header(key, ChunkKV(k, v, kv.meta), checksums, algorithm)
        with open(tmp, "xb") as f:
            f.write(header)
            for i in range(k.shape[0]):
                f.write(_bytes_view(k[i]))
                f.write(_bytes_view(v[i]))
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
            return f.tell()

    def _write_failed(self, key: str, exc: OSError) -> None:
        self.write_errors += 1
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        self.last_write_error = "disk full" if full else str(exc)
        first = self.write_errors == 1
        (log.warning if first else log.debug)(
            "KV store %s: could not write entry %s… (%s); the chunk stays a miss",
            self.path, key[:16], "disk full" if full else exc,
        )

    # ------------------------------------------------------------------ eviction
    def _lru_order(self) -> list[tuple[int, str]]:
        order = []
        for key in self.keys():
            order.append((int(self.index.get(_STAMP + key, 0, retry=True)), key))
        order.sort()
        return order

    def _evict(self, keep: str | None = None, capacity: int | None = None) -> int:
        """Evict least recently used entries until the files fit ``capacity``."""
        capacity = self.capacity_bytes if capacity is None else capacity
        if self.nbytes <= capacity:
            return 0
        evicted = 0
        for _, key in self._lru_order():
            if self.nbytes <= capacity:
                break
            if key == keep:
                continue
            with self.index.transact(retry=True):
                entry = self._entry(key)
                if entry is None:
                    continue
                self.index.delete(_ENTRY + key, retry=True)
                self.index.delete(_STAMP + key, retry=True)
                self.index.incr(_BYTES, -int(entry.get("bytes", 0)), retry=True)
            _unlink(self.data_dir / str(entry.get("file")))
            self._count("evictions")
            evicted += 1
        return evicted

    def lru_keys(self) -> list[str]:
        """Stored keys, least recently used first."""
        return [k for _, k in self._lru_order()]

    # ------------------------------------------------------------------ maintenance
    def verify(self, drop: bool = False) -> dict:
        """Read every entry and check it; ``drop`` removes the bad ones.

        Returns counts: ``ok``, ``corrupt`` (checksum/truncation/missing file), ``foreign``
        (other format or metadata mismatch) and ``errors`` (a list of (key, reason)).
        """
        report = {"ok": 0, "corrupt": 0, "foreign": 0, "errors": []}
        for key in list(self.keys()):
            status, reason = self._check(key)
            if status == "gone":
                continue
            report[status] += 1
            if status != "ok":
                report["errors"].append((key, reason))
                if drop:
                    entry = self._entry(key)
                    if entry is not None:
                        self._drop(key, self.data_dir / str(entry.get("file")), reason)
        return report

    def _check(self, key: str) -> tuple[str, str]:
        entry = self._entry(key)
        if entry is None:
            return "gone", ""
        if entry.get("version") != FORMAT_VERSION or not entry.get("file"):
            return "foreign", f"index entry of format v{entry.get('version')}"
        path = self.data_dir / str(entry.get("file"))
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            if self._entry(key) != entry:
                return "gone", ""  # evicted or rewritten by another process meanwhile
            return "corrupt", f"data file unreadable ({exc.strerror})"
        try:
            header = _read_header(fd, key)
            _check_matches(header, entry)
        except EntryInvalid as exc:
            os.close(fd)
            return exc.kind, str(exc)
        entry_kv = DiskChunkKV(None, key, path, fd, header)
        try:
            entry_kv.materialize()
        except CorruptEntryError as exc:
            return "corrupt", exc.reason
        finally:
            entry_kv.close()
        return "ok", ""

    def gc(self, grace_s: float = 3600.0) -> dict:
        """Drop bad entries, orphan and stale temp files, and evict down to capacity.

        Files younger than ``grace_s`` seconds are left alone (a writer may be about to
        rename or index them).
        """
        report = self.verify(drop=True)
        referenced = set()
        for key in self.keys():
            entry = self._entry(key)
            if entry is not None:
                referenced.add(str(entry.get("file")))
        now = time.time()
        orphans = 0
        for path in self.data_dir.glob("*/*.safetensors"):
            rel = f"{path.parent.name}/{path.name}"
            if rel not in referenced and now - _mtime(path) > grace_s:
                _unlink(path)
                orphans += 1
        stale = 0
        for path in self.tmp_dir.glob("*.tmp"):
            if now - _mtime(path) > grace_s:
                _unlink(path)
                stale += 1
        with self.index.transact(retry=True):  # recount the surviving entries' bytes exactly
            total = sum(int((self._entry(k) or {}).get("bytes", 0)) for k in self.keys())
            self.index.set(_BYTES, total, retry=True)
        evicted = self._evict()
        return {**report, "orphans": orphans, "stale_tmp": stale, "evicted": evicted}

    def drop_page_cache(self) -> bool:
        """Ask the OS to drop this store's files from the page cache (for cold reads).

        Returns False where ``posix_fadvise`` is unsupported (then reads may stay warm).
        """
        if not hasattr(os, "posix_fadvise"):
            log.info("posix_fadvise is unsupported here: the page cache cannot be dropped")
            return False
        for path in self.data_dir.glob("*/*.safetensors"):
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                return False
            finally:
                os.close(fd)
        return True

    def disk_usage(self) -> dict:
        """Bytes of entry files, index and temp files actually on disk."""

        def size(root: Path, pattern: str) -> int:
            total = 0
            for p in root.glob(pattern):
                try:
                    total += p.stat().st_size
                except OSError:
                    pass
            return total

        return {
            "data": size(self.data_dir, "*/*.safetensors"),
            "index": size(self.path / "index", "*"),
            "tmp": size(self.tmp_dir, "*"),
        }

    def close(self) -> None:
        self.index.close()

    def __repr__(self) -> str:
        return f"DiskStore({str(self.path)!r}, capacity_bytes={self.capacity_bytes})"


def _check_matches(header: _Header, entry: dict) -> None:
    """The file must be the one its index entry describes (same model, dtype and context)."""
    for field in ("fingerprint", "dtype", "context"):
        if header.meta.get(field) != entry.get(field):
            raise EntryInvalid(f"{field} differs from the index entry", "foreign")


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
