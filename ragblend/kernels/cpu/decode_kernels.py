"""The decode step's attention kernels: one call per layer for a batch of requests, each
request's one new query row over its own preallocated K/V (``csrc/decode_step.h``).

Three builds, each checked against SDPA when it loads:

- fp32 math over fp32 or bf16 K/V (``csrc/decode_attention_f32.cpp``), in the fp32 kernels'
  extension (AVX2, 8 lanes) and again at 16 lanes (:data:`DECODE_512`) where the CPU is at
  the ``avx512`` level: a bf16 element is widened exactly, so its output equals what fp32
  buffers of the same values give, bit for bit;
- bf16 in AVX512-BF16 dot products (``csrc/decode_attention_bf16.cpp``), in the bf16
  kernels' extension (``avx512_bf16`` and above): SDPA's bf16 arithmetic (bf16 products summed
  in fp32, the probabilities rounded to bf16 for the values), twice the products per
  instruction and no widening.

Decode caches of 8-bit codes (``BlendConfig.kv_cache_dtype="int8"``) have their own kernel:
:mod:`ragblend.kernels.cpu.decode_q8`.

Every build cuts a request's keys into blocks by its own position only and merges them in
order, so a request decoded in a batch gets exactly what it gets alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ragblend import cpu
from ragblend.errors import RagblendError
from ragblend.kernels.cpu.extensions import ATEN_AVX512, AVX512, Build, load_ops

log = logging.getLogger(__name__)

# q [1, H, B, d], k_new, v_new [1, Hkv, B, d], keys[b], values[b] [1, Hkv, capacity, d]
# (written at positions[b]), positions [B], window (0: none), scale -> fp32 [1, B, H*d]
DecodeKernel = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        list[torch.Tensor],
        list[torch.Tensor],
        list[int],
        int,
        float,
    ],
    torch.Tensor,
]

# csrc/decode_attention_f32.cpp built a second time at 16 lanes
DECODE_512 = Build(
    "avx512",
    "ragblend_decode512",
    ("-O3", *ATEN_AVX512, *AVX512, "-mfma", "-ffp-contract=off", "-fopenmp")
    + ("-DRAGBLEND_DECODE_512", "-DRAGBLEND_DECODE_NS=ragblend_decode512"),
)

# the kernels' tolerance against SDPA in fp32 over the same values: fp32 rounding for fp32
# math; for bf16, the probabilities' rounding to bf16 (as SDPA's bf16 kernel rounds them)
_TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


def decode_kernel(ops: Any, dtype: torch.dtype) -> DecodeKernel | None:
    """The decode attention of a native kernels' extension (``ops``, built for ``dtype``),
    checked: fp32's, or its 16-lane build where the CPU has it (:func:`widest_fp32`); bf16's,
    or None with one warning where it fails its check (bf16 models then decode through the
    fp32 kernel over their bf16 K/V). RagblendError where the fp32 one fails its check."""
    if dtype == torch.float32:
        check(ops.decode_attend, torch.float32)
        return widest_fp32(ops.decode_attend)
    try:
        check(ops.decode_attend, dtype)
    except RagblendError as exc:
        log.warning("%s; bf16 decode steps attend in fp32", exc)
        return None
    return ops.decode_attend


def widest_fp32(avx2: DecodeKernel) -> DecodeKernel:
    """The 16-lane build of the fp32 decode attention (:data:`DECODE_512`) where the CPU
    level is at least its level and it passes :func:`check`; else ``avx2`` (the fp32
    kernels' own, already checked), with one warning saying why where the wider one fails."""
    if not cpu.isa_at_least(DECODE_512.level):
        return avx2
    try:
        wide = load_512()
        check(wide, torch.float32)
    except Exception as exc:  # compiler failing, or a wrong result: the message says which
        log.warning("ragblend's AVX512 decode attention does not run (%s); using the AVX2 one", exc)
        return avx2
    return wide


def load_512() -> DecodeKernel:
    """The 16-lane build of the fp32 decode attention, compiled (or loaded) and unchecked;
    whatever the compiler or loader raises."""
    kernel: DecodeKernel = load_ops(
        DECODE_512.name, ("decode_attention_f32.cpp",), DECODE_512.flags
    ).decode_attend
    return kernel


def check(attend: DecodeKernel, dtype: torch.dtype) -> None:
    """RagblendError unless the kernel, on random ``dtype`` q and K/V (head dims 32 and 64;
    a window on, GQA, two requests of different lengths, one over several key blocks), writes
    each request's new K/V at its position, gives SDPA's attention over its keys within
    ``_TOLERANCE`` and gives each request alone what it gives it batched; for fp32, also that
    over bf16 K/V it gives what fp32 buffers of those values give, bit for bit."""
    for dim in (32, 64):
        gen = torch.Generator().manual_seed(dim)
        q = torch.randn(1, 4, 2, dim, generator=gen).to(dtype)
        k_new, v_new = torch.randn(2, 1, 2, 2, dim, generator=gen).to(dtype)
        keys = [torch.randn(1, 2, n, dim, generator=gen).to(dtype) for n in (1200, 40)]
        values = [torch.randn(1, 2, n, dim, generator=gen).to(dtype) for n in (1200, 40)]
        positions, window = [1100, 30], 1000
        want = _sdpa(q, k_new, v_new, keys, values, positions, window)
        given = [[t.clone() for t in ts] for ts in (keys, values)]
        got = attend(q, k_new, v_new, keys, values, positions, window, 0.2)
        written = all(
            torch.equal(keys[b][:, :, p], k_new[:, :, b])
            and torch.equal(values[b][:, :, p], v_new[:, :, b])
            for b, p in enumerate(positions)
        )
        atol, rtol = _TOLERANCE[dtype]
        if not written or not torch.allclose(got, want, atol=atol, rtol=rtol):
            raise RagblendError(f"the native {dtype} decode attention does not match SDPA's")
        alone = [
            attend(
                q[:, :, b : b + 1].contiguous(),
                k_new[:, :, b : b + 1].contiguous(),
                v_new[:, :, b : b + 1].contiguous(),
                [given[0][b]],
                [given[1][b]],
                [p],
                window,
                0.2,
            )
            for b, p in enumerate(positions)
        ]
        if not torch.equal(torch.cat(alone, dim=1), got):
            raise RagblendError(f"the native {dtype} decode attention depends on the batch")
        if dtype == torch.float32:
            _check_bf16_kv(attend, q, k_new, v_new, keys, values, positions, window)


def _check_bf16_kv(
    attend: DecodeKernel,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    positions: list[int],
    window: int,
) -> None:
    """RagblendError unless the fp32 kernel over bf16 K/V gives what it gives over fp32
    buffers of the same values, bit for bit, its new bf16 K/V written as given."""
    bf16 = [[t.bfloat16() for t in ts] for ts in (keys, values)]
    k16, v16 = k_new.bfloat16(), v_new.bfloat16()
    got16 = attend(q, k16, v16, bf16[0], bf16[1], positions, window, 0.2)
    widened = [[t.float() for t in ts] for ts in bf16]
    same = attend(q, k16.float(), v16.float(), widened[0], widened[1], positions, window, 0.2)
    written = all(torch.equal(bf16[0][b][:, :, p], k16[:, :, b]) for b, p in enumerate(positions))
    if not written or not torch.equal(got16, same):
        raise RagblendError("the native decode attention over bf16 K/V differs from fp32's")


def _sdpa(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    positions: list[int],
    window: int,
) -> torch.Tensor:
    """SDPA in fp32 of each request's query row over its keys with its new K/V in place
    (the buffers untouched) -> [1, B, H*d]."""
    want = []
    for b, p in enumerate(positions):
        k, v = keys[b].clone(), values[b].clone()
        k[:, :, p], v[:, :, p] = k_new[:, :, b], v_new[:, :, b]
        lo = max(0, p - window + 1) if window else 0
        want.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, b : b + 1].float(),
                k[:, :, lo : p + 1].float(),
                v[:, :, lo : p + 1].float(),
                scale=0.2,
                enable_gqa=True,
            )
        )
    return torch.cat(want, dim=2).transpose(1, 2).reshape(1, len(positions), -1)
