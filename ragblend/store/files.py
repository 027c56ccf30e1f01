"""The disk tier's files: listing, index rebuild from headers, sweeping, page cache, sizes."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path

from ragblend.store import codec
from ragblend.store.codec import EntryInvalid
from ragblend.store.index import IndexEntry

log = logging.getLogger(__name__)


def entry_files(data_dir: Path) -> Iterator[Path]:
    """Every entry file under ``data_dir`` (``ab/<key>.<rand>.safetensors``)."""
    return data_dir.glob("*/*.safetensors")


def scan_entry_files(data_dir: Path) -> Iterator[IndexEntry]:
    """Index rows for every readable entry file, newest first (one per key)."""
    files = sorted(entry_files(data_dir), key=mtime, reverse=True)
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            header = codec.read_header(fd)
        except (EntryInvalid, OSError):
            continue
        finally:
            os.close(fd)
        m = header.meta
        yield IndexEntry(
            key=header.key,
            file=f"{path.parent.name}/{path.name}",
            bytes=header.file_size,
            version=codec.FORMAT_VERSION,
            fingerprint=m["fingerprint"],
            dtype=m["dtype"],
            kv_dtype=m["kv_dtype"],
            context=m["context"],
            tokens=header.num_tokens,
            created=mtime(path),
        )


def remove_old(paths: Iterable[Path], grace_s: float, keep: AbstractSet[str] = frozenset()) -> int:
    """Delete files older than ``grace_s`` seconds whose ``parent/name`` is not in ``keep``;
    returns how many were deleted (younger files may belong to a writer in flight)."""
    now, removed = time.time(), 0
    for path in paths:
        if f"{path.parent.name}/{path.name}" not in keep and now - mtime(path) > grace_s:
            unlink(path)
            removed += 1
    return removed


def drop_page_cache(paths: Iterable[Path]) -> bool:
    """``posix_fadvise(DONTNEED)`` every file; False where the OS does not support it."""
    if not hasattr(os, "posix_fadvise"):
        log.info("posix_fadvise is unsupported here: the page cache cannot be dropped")
        return False
    for path in paths:
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


def total_size(paths: Iterable[Path]) -> int:
    total = 0
    for path in paths:
        try:
            total += path.stat().st_size
        except OSError:
            pass
    return total


def unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return time.time()


def fsync_dir(path: Path) -> None:
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
