"""Compiling ragblend's C++ kernels (``ragblend/fusion/csrc``) with torch's JIT extension
loader, once per machine (torch caches the build; ninja rebuilds what an edited source or
header touches)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

CSRC = Path(__file__).resolve().parent / "fusion" / "csrc"
# the instruction sets every AVX512 build of ragblend's kernels targets (F/BW/VL/DQ)
AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
# at::vec's 16-lane code, for a source that uses ATen's vectorized types
ATEN_AVX512 = ("-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512")


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


def load_ops(name: str, sources: Sequence[str], flags: Sequence[str]) -> Any:
    """Compile (or load the cached build of) the extension ``name`` from ``sources`` (file
    names in :data:`CSRC`) with ``flags``; its op namespace, ``torch.ops.<name>``. Raises
    whatever the compiler or loader raises."""
    from torch.utils.cpp_extension import load

    ensure_ninja()
    load(
        name=name,
        sources=[str(CSRC / source) for source in sources],
        extra_cflags=list(flags),
        is_python_module=False,
    )
    return getattr(torch.ops, name)
