"""Compiling ragblend's C++ kernels (``ragblend/kernels/cpu/csrc``) with torch's JIT extension
loader, once per machine (torch caches the build; ninja rebuilds what an edited source or
header touches)."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
# the instruction sets every AVX512 build of ragblend's kernels targets (F/BW/VL/DQ)
AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
# at::vec's 16-lane code, for a source that uses ATen's vectorized types
ATEN_AVX512 = ("-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512")


Loaded = TypeVar("Loaded")


class Build(NamedTuple):
    """One compiled variant of a kernel source: the CPU level it needs, its op namespace (the
    extension's name) and its compiler flags."""

    level: str
    name: str
    flags: tuple[str, ...]


def ensure_ninja() -> None:
    """Put the ninja wheel's binary on PATH where no ``ninja`` is: torch's extension builds
    run it from PATH, and the wheel installs it beside this interpreter, which is not on PATH
    when the venv is used without activating it."""
    if shutil.which("ninja") is None:
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def build_directory(name: str) -> Path:
    """The folder torch builds the extension ``name`` in (under ``TORCH_EXTENSIONS_DIR`` when
    set), created if missing: computed by torch's own rule so that :func:`load_ops` can hand
    it to ``load`` and keep its lock file beside torch's ``lock`` baton."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


@contextmanager
def build_lock(name: str, directory: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<directory>/ragblend.flock`` while compiling or loading
    ``name``. torch's own lock is a ``lock`` file that its creator removes when done, so a
    build killed mid-way leaves it behind and every later ``load`` polls it forever; the kernel
    releases a flock when its holder dies, so this one never goes stale. While we hold it no
    other ragblend process is building here, so a ``lock`` file found now is a dead build's:
    remove it (one warning) and let ninja redo what that build left unfinished."""
    with open(directory / "ragblend.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released on close, or when this process dies
        baton = directory / "lock"
        if baton.exists():
            baton.unlink()
            logger.warning(
                "removed a stale build lock left by an interrupted compile of %s (%s); rebuilding",
                name,
                baton,
            )
        yield


def load_ops(name: str, sources: Sequence[str], flags: Sequence[str], *, csrc: Path = CSRC) -> Any:
    """Compile (or load the cached build of) the extension ``name`` from ``sources`` (file
    names in ``csrc``, by default :data:`CSRC`) with ``flags``; its op namespace,
    ``torch.ops.<name>``. Processes loading the same extension take turns (:func:`build_lock`),
    and a build an earlier process was killed in is redone rather than waited on forever.
    Raises whatever the compiler or loader raises."""
    from torch.utils.cpp_extension import load

    ensure_ninja()
    directory = build_directory(name)
    with build_lock(name, directory):
        load(
            name=name,
            sources=[str(csrc / source) for source in sources],
            extra_cflags=list(flags),
            build_directory=str(directory),
            is_python_module=False,
        )
    return getattr(torch.ops, name)


def widest_that_loads(
    builds: Sequence[Build],
    load: Callable[[Build], Loaded],
    runs: Callable[[Build], bool],
    what: str,
    log: logging.Logger,
) -> Loaded | None:
    """``load(build)`` for the first of ``builds`` (widest first) that ``runs`` on this CPU.
    Where a wider one raises (a compiler failing, a load-time check): one warning on ``log``
    ("ragblend's <level> build <name> of its <what> fails (<why>); using the next build"), then
    the next. The narrowest that runs raises what it raised (its caller says what that leaves);
    None where none runs here."""
    candidates = [build for build in builds if runs(build)]
    for build in candidates[:-1]:
        try:
            return load(build)
        except Exception as exc:  # the message says which: compiler, loader or check
            log.warning(
                "ragblend's %s build %s of its %s fails (%s); using the next build",
                build.level,
                build.name,
                what,
                exc,
            )
    return load(candidates[-1]) if candidates else None
