"""Compute dtype names → torch dtypes, with ``"auto"``: per CPU level, what was measured fastest."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ragblend import cpu
from ragblend.errors import RagblendError

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES: tuple[str, ...] = ("auto", *DTYPES)

_warned_slow_bf16 = False


@dataclass(frozen=True)
class AutoChoice:
    """What ``dtype="auto"`` picks at one CPU level, phase by phase, and what it rests on.

    ``prefill``: the dtype prefills (full, blend's recomputed rows) compute in. ``decode``:
    what a decode step computes in — the dense weights it reads (a quantized GGUF decodes on
    its blocks at every level, with activations in this dtype). Where the two differ the
    model would need a copy of its weights per phase; no level measured so far wants that.
    """

    prefill: torch.dtype
    decode: torch.dtype
    measured: str  # the CPU, date and benchmark the choice comes from
    why: str


F32, BF16 = torch.float32, torch.bfloat16
# Blend TTFT and decode tok/s of the embedded model, 2 cores, 6 x 512-token prompts.
AUTO_BY_LEVEL: dict[str, AutoChoice] = {
    "baseline": AutoChoice(F32, F32, "not measured", "no bf16 instructions"),
    "avx2": AutoChoice(
        F32,
        F32,
        "AMD EPYC Zen 3, 2026-11-24, ragblend bench (issue 40's table)",
        "no bf16 instructions: bf16 matmuls convert in software; fp32 blend 1.52 s, 24.5 tok/s",
    ),
    "avx512": AutoChoice(
        F32,
        F32,
        "no CPU of this class measured; as avx2",
        "AVX512 without AVX512-BF16 converts bf16 in software as AVX2 does",
    ),
    "avx512_bf16": AutoChoice(
        BF16,
        BF16,
        "AMD EPYC Zen 5, 2026-11-26, benchmarks/decode/quant_weights.py (amd-avx512bf16/)",
        "bf16 vs fp32: blend 346 vs 1190 ms, decode 90.6 vs 72.2 tok/s, blend + 64 tokens "
        "1053 vs 2077 ms (kept Q4_1; dequantized: decode 81.9 vs 44.3 tok/s)",
    ),
    "amx": AutoChoice(
        BF16,
        BF16,
        "Intel Xeon with AMX-BF16, 2026-11-23, ragblend bench (intel-amx/bench_bf16, bench_fp32)",
        "bf16 vs fp32: blend 349 vs 1136 ms, full 1.74 vs 4.59 s, decode 28.3 vs 20.6 tok/s",
    ),
}


def auto_choice() -> AutoChoice:
    """The row of :data:`AUTO_BY_LEVEL` for this CPU's (capped) level."""
    return AUTO_BY_LEVEL[cpu.cpu_isa()]


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bf16 on CUDA; on CPU the prefill dtype :data:`AUTO_BY_LEVEL` holds for the CPU's level
    (bf16 at ``avx512_bf16`` and ``amx``, fp32 below)."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return auto_choice().prefill


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
