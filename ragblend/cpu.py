"""What the CPU can do: one ISA level that every CPU-specific choice in ragblend reads.

The levels, each including the ones before it:

- ``baseline``: no AVX2 (another architecture, or an old x86 CPU). Generic code only.
- ``avx2``: AVX2 + FMA (AMD Zen 1-3, Intel before Skylake-SP, most laptops). fp32 is the fast
  dtype; bf16 runs, slowly, through conversions.
- ``avx512``: AVX512 F/BW/VL/DQ (Intel Skylake-SP on, AMD Zen 4 on). oneDNN can pack bf16.
- ``avx512_bf16``: AVX512 with its bf16 dot products. bf16 matmuls at native throughput.
- ``amx``: AMX tiles with bf16 (Intel Sapphire Rapids on). ragblend's AMX kernels run here.

``RAGBLEND_CPU_ISA`` (one of :data:`LEVELS`) caps the level, never above
what the CPU has, so a big machine runs the paths of a small one. It caps ragblend's own
choices (the ``"auto"`` dtype, packed decoding, the native kernels); torch's kernels follow
their own variables, ``ATEN_CPU_CAPABILITY`` and ``ONEDNN_MAX_CPU_ISA``, which must be set
before torch starts (``make test-avx2`` sets all three).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

from ragblend.errors import RagblendError

log = logging.getLogger(__name__)

ENV_CAP = "RAGBLEND_CPU_ISA"
LEVELS: tuple[str, ...] = ("baseline", "avx2", "avx512", "avx512_bf16", "amx")

# /proc/cpuinfo flags each level needs on top of the level below it.
_LEVEL_FLAGS: dict[str, frozenset[str]] = {
    "baseline": frozenset(),
    "avx2": frozenset({"avx2", "fma"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    "avx512_bf16": frozenset({"avx512_bf16"}),
    "amx": frozenset({"amx_tile", "amx_bf16"}),
}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo spells them (empty where it does not exist)."""
    for line in _cpuinfo_lines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``)."""
    for line in _cpuinfo_lines():
        if line.startswith(("model name", "Model")):
            return line.partition(":")[2].strip()
    return platform.processor() or platform.machine() or "unknown"


def native_level(flags: frozenset[str] | None = None) -> str:
    """The highest level whose flags (and every lower level's) ``flags`` has."""
    have = cpu_flags() if flags is None else flags
    level = LEVELS[0]
    for name in LEVELS[1:]:
        if not _LEVEL_FLAGS[name] <= have:
            break
        level = name
    return level


def cpu_isa() -> str:
    """The level ragblend uses: the CPU's own, capped by ``RAGBLEND_CPU_ISA`` when it is set.

    An unknown value is a RagblendError naming the levels; a cap above the CPU's level is
    the CPU's level (logged once).
    """
    return _capped(os.environ.get(ENV_CAP, "").strip().lower(), native_level())


def isa_at_least(level: str) -> bool:
    """True when :func:`cpu_isa` is ``level`` or above."""
    return _rank(cpu_isa()) >= _rank(level)


def has_fast_bf16() -> bool:
    """True when bf16 matmuls run at native throughput (AVX512-BF16 or AMX)."""
    return isa_at_least("avx512_bf16")


def onednn_packs_bf16() -> bool:
    """True when oneDNN can reorder bf16 weights for its one-row linears: AVX512 (BW/VL/DQ)
    or AVX-NE-CONVERT, which is what its ``mkldnn_reorder_linear_weight`` asks of the CPU."""
    return isa_at_least("avx512") or (isa_at_least("avx2") and "avx_ne_convert" in cpu_flags())


def describe() -> dict[str, str]:
    """``cpu_isa``, ``cpu_model`` and torch's own kernel level, for benchmark settings."""
    import torch

    return {
        "cpu_isa": cpu_isa(),
        "cpu_model": cpu_model(),
        "torch_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
    }


def _rank(level: str) -> int:
    try:
        return LEVELS.index(level)
    except ValueError:
        raise RagblendError(
            f"unknown CPU level {level!r}; expected one of {', '.join(LEVELS)}"
        ) from None


@functools.cache
def _capped(cap: str, native: str) -> str:
    if not cap:
        return native
    if cap not in LEVELS:
        raise RagblendError(
            f"{ENV_CAP}={cap!r} is not a CPU level; expected one of {', '.join(LEVELS)}"
        )
    if _rank(cap) > _rank(native):
        log.warning("%s=%s is above this CPU's level (%s); using %s", ENV_CAP, cap, native, native)
        return native
    return cap


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()
