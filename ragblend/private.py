"""Owner-only files: everything ragblend creates under ``$RAGBLEND_HOME`` or a store path.

Cached KV encodes the text of users' documents, so its directories are created 0700 and its
files 0600 whatever the process umask. Modes are set explicitly on each new file and directory
(``os.open``/``os.mkdir`` with the mode, then ``fchmod``/``chmod``): changing the umask is
process-wide and so unsafe with threads. A directory that already exists with group or other
bits gets one warning per process naming it and the fix; ``loose_paths`` lists every such
entry of a tree (``ragblend cache verify`` reports them).
"""

from __future__ import annotations

import logging
import os
import shlex
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from ragblend.paths import ragblend_home

log = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
_OTHERS = 0o077  # group and other bits: none may be set on a private entry
_warned: set[str] = set()
_warned_lock = threading.Lock()


def is_loose(mode: int) -> bool:
    """True when ``mode`` (an ``st_mode``) gives the group or others any access."""
    return bool(stat.S_IMODE(mode) & _OTHERS)


def private_dir(path: str | os.PathLike, check: bool = True) -> Path:
    """Create ``path`` and its missing parents owner-only (0700); returns it as a ``Path``.

    Directories that already exist are left as they are. With ``check``, if ``path`` itself
    existed and the group or others can access it, one warning per directory per process names
    it and the fix; a path under ``$RAGBLEND_HOME`` also gets the home checked (or created).
    Inner directories of a store pass ``check=False``: its root keeps them from others.
    """
    path = Path(path)
    home = ragblend_home().absolute()
    if check and path.absolute() != home and path.absolute().is_relative_to(home):
        private_dir(home)  # the root that keeps everything below from other users
    missing: list[Path] = []
    probe = path
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, DIR_MODE)
        except FileExistsError:  # another thread or process created it meanwhile
            continue
        os.chmod(directory, DIR_MODE)  # the umask may have removed owner bits
    if check and not missing:
        warn_if_loose(path)
    return path


def warn_if_loose(path: str | os.PathLike) -> bool:
    """Warn once per process when the directory ``path`` is open to the group or others.

    Returns True when it is loose (whether or not this call logged the warning).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if not is_loose(mode):
        return False
    key = os.path.abspath(path)
    with _warned_lock:
        first = key not in _warned
        _warned.add(key)
    if first:
        log.warning(
            "%s is accessible to other users (mode %o) and holds cached data of your "
            "documents: run `chmod 700 %s`",
            key,
            stat.S_IMODE(mode),
            shlex.quote(key),
        )
    return True


def open_private(path: str | os.PathLike) -> int:
    """A write-only descriptor of a new owner-only (0600) file at ``path``.

    Raises ``FileExistsError`` if ``path`` exists (the file is always a new one).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # the umask may have removed owner bits
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_private(path: str | os.PathLike, text: bool = False) -> IO:
    """A new owner-only file opened for writing (``"xb"`` or, with ``text``, ``"x"``)."""
    return os.fdopen(open_private(path), "w" if text else "wb")


def private_temp_file(directory: str | os.PathLike, prefix: str, suffix: str) -> tuple[int, str]:
    """``tempfile.mkstemp`` in ``directory`` with the file exactly 0600: ``(fd, name)``."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp asks for 0600, which the umask may cut further
    except BaseException:
        os.close(fd)
        os.unlink(name)
        raise
    return fd, name


def private_temp_dir(directory: str | os.PathLike, prefix: str) -> Path:
    """``tempfile.mkdtemp`` in ``directory`` with the directory exactly 0700."""
    path = tempfile.mkdtemp(dir=directory, prefix=prefix)
    os.chmod(path, DIR_MODE)
    return Path(path)


def touch_private(path: str | os.PathLike) -> None:
    """Create ``path`` as an empty owner-only file unless it exists (then it is left alone)."""
    try:
        os.close(open_private(path))
    except FileExistsError:
        pass


def make_private(root: str | os.PathLike) -> None:
    """Set owner-only modes on ``root`` and everything under it (for trees another library
    wrote, e.g. ``save_pretrained``, before they are moved into place)."""
    root = Path(root)
    os.chmod(root, DIR_MODE)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), DIR_MODE)
        for name in filenames:
            full = os.path.join(dirpath, name)
            if not os.path.islink(full):
                os.chmod(full, FILE_MODE)


def loose_paths(root: str | os.PathLike) -> Iterator[tuple[Path, int]]:
    """``(path, mode)`` of ``root`` and every entry under it open to the group or others."""
    root = Path(root)
    if not root.exists():
        return
    stack = [root]
    while stack:
        path = stack.pop()
        try:
            st = path.lstat()
        except OSError:  # removed while we walked
            continue
        if stat.S_ISLNK(st.st_mode):
            continue
        if is_loose(st.st_mode):
            yield path, stat.S_IMODE(st.st_mode)
        if stat.S_ISDIR(st.st_mode):
            try:
                stack.extend(sorted(path.iterdir(), reverse=True))
            except OSError:
                continue
