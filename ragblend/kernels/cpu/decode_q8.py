"""The 8-bit decode-time K/V cache (``BlendConfig.kv_cache_dtype="int8"``) and its attention.

The cache holds llama.cpp's q8_0 layout (:func:`quantize_q8`: int8 codes, one fp32 scale per
32 values along the head dim; one per row where 32 does not divide it). A decode step attends
in fp32 over the dequantized values: the native kernel (``csrc/decode_attention_int8.cpp``, at
16 lanes where the CPU is at the ``avx512`` level and the head dim allows, else at 8 (AVX2):
:data:`Q8_BUILDS`, :func:`native_q8`, checked against SDPA when it loads), which also
quantizes the new token's K/V as it writes them, or :func:`attend_q8_torch` (SDPA per request)
where it does not run. A request's result is the same alone and in a batch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from ragblend import cpu
from ragblend.errors import RagblendError
from ragblend.kernels.cpu.decode_kernels import _TOLERANCE, DECODE_512
from ragblend.kernels.cpu.extensions import Build, load_ops
from ragblend.kernels.cpu.native import BUILDS

if TYPE_CHECKING:
    from ragblend.kernels.cpu.native import NativeKernels

log = logging.getLogger(__name__)


Q8_BLOCK = 32  # values per scale along the head dim (llama.cpp's q8_0)
# AVX2 + FMA, at::vec's 8-lane code: built as the fp32 kernels' extension is
DECODE_Q8 = Build("avx2", "ragblend_decode_q8", BUILDS[torch.float32].flags)
# the same source at 16 lanes (decode_lanes.h's AVX512 half): built as the 16-lane fp32 decode
# attention is
DECODE_Q8_512 = Build(
    DECODE_512.level,
    "ragblend_decode_q8_512",
    (*DECODE_512.flags, "-DRAGBLEND_DECODE_Q8_NS=ragblend_decode_q8_512"),
)
# widest first, with each build's lanes: the head dim and its scale block must be multiples
Q8_BUILDS: tuple[tuple[Build, int], ...] = ((DECODE_Q8_512, 16), (DECODE_Q8, 8))

# q [1, H, B, d], k_new, v_new [1, Hkv, B, d] (fp32), keys[b], key_scales[b], values[b],
# value_scales[b] (int8 codes [1, Hkv, capacity, d], fp32 scales [1, Hkv, capacity, d / block];
# the new K/V quantized and written at positions[b]), positions [B], window (0: none), scale
# -> fp32 [1, B, H*d]
Q8Kernel = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        list[torch.Tensor],
        list[torch.Tensor],
        list[torch.Tensor],
        list[torch.Tensor],
        list[int],
        int,
        float,
    ],
    torch.Tensor,
]


def q8_block(head_dim: int) -> int:
    """Values per scale for rows of ``head_dim``: :data:`Q8_BLOCK` where it divides it, else
    the whole row (one scale per token per KV head)."""
    return Q8_BLOCK if head_dim % Q8_BLOCK == 0 else head_dim


def quantize_q8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> (int8 codes [..., d], fp32 scales [..., d / block]): per ``block``
    consecutive values, scale = amax / 127, code = round-half-even(x / scale) (0 for an
    all-zero block), so |x - code * scale| <= scale / 2. The codes the native kernel writes
    for a new token are these, bit for bit."""
    rows = x.float().unflatten(-1, (-1, block))
    scales = rows.abs().amax(-1) / 127
    divisors = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = torch.round(rows / divisors.unsqueeze(-1)).clamp_(-127, 127)
    return codes.to(torch.int8).flatten(-2), scales


def dequantize_q8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 codes [..., d], fp32 scales [..., d / block] -> fp32 [..., d]: code * scale."""
    rows = codes.unflatten(-1, (scales.shape[-1], -1)).float()
    return (rows * scales.unsqueeze(-1)).flatten(-2)


def attend_q8_torch(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    keys: list[torch.Tensor],
    key_scales: list[torch.Tensor],
    values: list[torch.Tensor],
    value_scales: list[torch.Tensor],
    positions: list[int],
    window: int,
    scale: float,
) -> torch.Tensor:
    """:data:`Q8Kernel` in torch: each request's new K/V quantized (:func:`quantize_q8`) and
    written at its position, then fp32 SDPA of its query row over its dequantized keys
    [lo, p] -> fp32 [1, B, H*d]. Where the native kernel does not run; its reference."""
    block = q.shape[-1] // key_scales[0].shape[-1]
    outs = []
    for b, p in enumerate(positions):
        for codes, scales, new in (
            (keys[b], key_scales[b], k_new),
            (values[b], value_scales[b], v_new),
        ):
            c, s = quantize_q8(new[:, :, b : b + 1], block)
            codes[:, :, p : p + 1].copy_(c)
            scales[:, :, p : p + 1].copy_(s)
        lo = max(0, p - window + 1) if window else 0
        k = dequantize_q8(keys[b][:, :, lo : p + 1], key_scales[b][:, :, lo : p + 1])
        v = dequantize_q8(values[b][:, :, lo : p + 1], value_scales[b][:, :, lo : p + 1])
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[:, :, b : b + 1].float(), k, v, scale=scale, enable_gqa=True
            )
        )
    return torch.cat(outs, dim=2).transpose(1, 2).reshape(1, len(positions), -1)


_Q8: dict[str, Q8Kernel | None] = {}  # build name -> its checked kernel (or None), per process


def native_q8(head_dim: int = 64) -> Q8Kernel | None:
    """The native int8-cache decode attention (``csrc/decode_attention_int8.cpp``) for heads of
    ``head_dim``: the widest of :data:`Q8_BUILDS` the CPU level allows whose lanes divide the
    head dim and its scale block (:func:`q8_block`), each compiled (or loaded) and checked once
    per process (:func:`check_q8`). A wider build that fails is one warning, then the next;
    None where the head dim is not a multiple of 8, and (with one warning saying why) where
    the CPU is below ``avx2`` or the AVX2 build does not run."""
    for build, lanes in Q8_BUILDS:
        if head_dim % lanes or q8_block(head_dim) % lanes:
            continue
        if build.name not in _Q8:
            _Q8[build.name] = _load_q8(build, last=build is Q8_BUILDS[-1][0])
        kernel = _Q8[build.name]
        if kernel is not None:
            return kernel
    return None


def q8_kernel(build: Build) -> Q8Kernel:
    """``build``'s kernel (one of :data:`Q8_BUILDS`), compiled (or loaded) and checked
    (:func:`check_q8`) now: RagblendError where the CPU is below its level, else whatever the
    compiler, the loader or the check raises."""
    if not cpu.isa_at_least(build.level):
        raise RagblendError(f"it needs CPU level {build.level}, this one is at {cpu.cpu_isa()}")
    ops = load_ops(build.name, ("decode_attention_int8.cpp",), build.flags)
    check_q8(ops.decode_attend_q8)
    kernel: Q8Kernel = ops.decode_attend_q8
    return kernel


def _load_q8(build: Build, last: bool) -> Q8Kernel | None:
    """:func:`q8_kernel`, or None where it raises: silently where the CPU is below a wider
    build's level, else with one warning saying why."""
    if not last and not cpu.isa_at_least(build.level):
        return None
    try:
        return q8_kernel(build)
    except Exception as exc:  # compiler failing, or a wrong result: the message says which
        if last:
            log.warning(
                "ragblend's native int8 K/V decode attention does not run (%s); int8 decode "
                "caches are dequantized for SDPA per request",
                exc,
            )
        else:
            log.warning(
                "ragblend's %s int8 K/V decode attention does not run (%s); using the next",
                build.level,
                exc,
            )
        return None


def check_q8(attend: Q8Kernel) -> None:
    """RagblendError unless the kernel, on random fp32 q and new K/V over random int8 caches
    (head dims 32, 48 (one scale per row), 64 and 128; GQA; a window; two requests, one over
    several key blocks, positions not multiples of 32), writes the codes and scales
    :func:`quantize_q8` gives, gives :func:`attend_q8_torch`'s attention (SDPA over the
    dequantized K/V) within fp32's tolerance and gives each request alone what it gives it
    batched, bit for bit."""
    atol, rtol = _TOLERANCE[torch.float32]
    for dim in (32, 48, 64, 128):
        case = _q8_case(dim)
        got, written = _run_q8(attend, case, [0, 1])
        want, expected = _run_q8(attend_q8_torch, case, [0, 1])
        if not all(torch.equal(a, b) for a, b in zip(written, expected)):
            raise RagblendError("the native int8 decode attention writes other codes than torch's")
        if not torch.allclose(got, want, atol=atol, rtol=rtol):
            raise RagblendError("the native int8 decode attention does not match SDPA's")
        alone = torch.cat([_run_q8(attend, case, [b])[0] for b in (0, 1)], dim=1)
        if not torch.equal(alone, got):
            raise RagblendError("the native int8 decode attention depends on the batch")


class Q8Case(NamedTuple):
    """Inputs of one :func:`check_q8` case: q [1, 4, 2, d], k_new, v_new [1, 2, 2, d] (fp32),
    ``caches[b]`` = (key codes, key scales, value codes, value scales) of request b."""

    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    caches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    positions: list[int]
    window: int


def _q8_case(dim: int) -> Q8Case:
    """Random inputs for :func:`check_q8`: requests of 1200 and 40 keys at positions 1101 and
    30, window 1000."""
    gen = torch.Generator().manual_seed(dim)
    q = torch.randn(1, 4, 2, dim, generator=gen)
    k_new, v_new = torch.randn(2, 1, 2, 2, dim, generator=gen)
    caches = []
    for n in (1200, 40):
        k, v = torch.randn(2, 1, 2, n, dim, generator=gen)
        caches.append((*quantize_q8(k, q8_block(dim)), *quantize_q8(v, q8_block(dim))))
    return Q8Case(q, k_new, v_new, caches, [1101, 30], 1000)


def _run_q8(
    attend: Q8Kernel, case: Q8Case, batch: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``attend`` on the requests ``batch`` of ``case`` (over copies of their caches): its
    output and the caches after it, keys, key scales, values, value scales."""
    bufs = [[case.caches[b][part].clone() for b in batch] for part in range(4)]
    q, k_new, v_new = (t[:, :, batch].contiguous() for t in (case.q, case.k_new, case.v_new))
    positions = [case.positions[b] for b in batch]
    keys, key_scales, values, value_scales = bufs
    got = attend(
        q, k_new, v_new, keys, key_scales, values, value_scales, positions, case.window, 0.2
    )
    return got, [t for part in bufs for t in part]


def int8_attention(
    device: torch.device, dtype: torch.dtype, head_dim: int, kernels: NativeKernels | None
) -> Q8Kernel:
    """The attention of int8 decode caches of a model on ``device`` computing in ``dtype``:
    the native kernel where the float path would run a native one (CPU, ``kernels`` given or
    a bf16 model: :func:`decode_attention`) and it runs here (:func:`native_q8`), else SDPA
    per request over the dequantized K/V."""
    native = device.type == "cpu" and (kernels is not None or dtype == torch.bfloat16)
    kernel = native_q8(head_dim) if native else None
    return kernel if kernel is not None else attend_q8_torch


def q8_buffer(x: torch.Tensor, capacity: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt layer's K or V [1, Hkv, n, d] quantized into new int8 codes [1, Hkv, capacity,
    d] and fp32 scales [1, Hkv, capacity, d / block], at [position - n, position)."""
    n, dim = x.shape[-2], x.shape[-1]
    codes, scales = quantize_q8(x, q8_block(dim))
    cb = codes.new_empty(*codes.shape[:-2], capacity, dim)
    sb = scales.new_empty(*scales.shape[:-2], capacity, scales.shape[-1])
    cb[..., position - n : position, :].copy_(codes)
    sb[..., position - n : position, :].copy_(scales)
    return cb, sb
