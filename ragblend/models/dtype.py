"""Compute dtype names → torch dtypes, with ``"auto"``: bf16 where the hardware runs it fast."""

from __future__ import annotations

from pathlib import Path

import torch

from ragblend.errors import RagblendError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES: tuple[str, ...] = ("auto", *DTYPES)

# CPU flags (as /proc/cpuinfo spells them) that give bf16 matmuls native throughput.
BF16_CPU_FLAGS = frozenset({"amx_bf16", "avx512_bf16"})


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has AMX-BF16 or AVX512-BF16 and torch's kernels can use them.

    torch's capability string says which ISA its kernels dispatch to ("AVX512", "AMX", …);
    the flags say whether that ISA includes the bf16 instructions.
    """
    capability = str(torch.backends.cpu.get_cpu_capability()).upper()
    if "AVX512" not in capability and "AMX" not in capability:
        return False
    return bool(BF16_CPU_FLAGS & cpu_flags())


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bf16 on CUDA and on CPUs with fast bf16 (see ``cpu_has_fast_bf16``), fp32 elsewhere."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.bfloat16
    if kind == "cpu" and cpu_has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype name (``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``) → torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device)
    try:
        return DTYPES[dtype]
    except KeyError:
        raise RagblendError(
            f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_NAMES)}"
        ) from None
