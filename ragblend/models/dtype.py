"""Compute dtype names → torch dtypes, with ``"auto"``: bf16 where the hardware runs it fast."""

from __future__ import annotations

import logging

import torch

from ragblend import cpu
from ragblend.errors import RagblendError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES: tuple[str, ...] = ("auto", *DTYPES)

_warned_slow_bf16 = False


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bf16 on CUDA and on CPUs with bf16 instructions (``ragblend.cpu.has_fast_bf16``: the
    ``avx512_bf16`` and ``amx`` levels), fp32 elsewhere."""
    kind = torch.device(device).type
    if kind == "cuda":
        return torch.bfloat16
    if kind == "cpu" and cpu.has_fast_bf16():
        return torch.bfloat16
    return torch.float32


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """A dtype name (``"auto"``, ``"float32"``, ``"bfloat16"``, ``"float16"``) → torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device)
    try:
        resolved = DTYPES[dtype]
    except KeyError:
        raise RagblendError(
            f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPE_NAMES)}"
        ) from None
    if resolved == torch.bfloat16 and torch.device(device).type == "cpu":
        _warn_if_slow_bf16()
    return resolved


def _warn_if_slow_bf16() -> None:
    """Once per process: bf16 asked for on a CPU without bf16 instructions."""
    global _warned_slow_bf16
    if _warned_slow_bf16 or cpu.has_fast_bf16():
        return
    _warned_slow_bf16 = True
    log.warning(
        "bfloat16 on a CPU at level %s (%s): no bf16 instructions, so matmuls convert to "
        "fp32 and run slower than float32; dtype='auto' picks float32 here",
        cpu.cpu_isa(),
        cpu.cpu_model(),
    )
