"""ragblend's CPU kernels for the fusor, compiled on first use (once per machine).

SDPA has no CPU kernel that lets each query row attend exactly its own causal prefix: blend's
selected rows sit anywhere in the prompt, so :func:`attend_rows` otherwise runs them through
SDPA in position-ordered blocks with additive masks, each block reading keys up to its last
row. ``csrc/rows_attention.cpp`` does the whole layer in one call: bf16 tile matmuls (ATen's
brgemm micro-kernel: AMX tiles, or AVX512-BF16 dot products) over row tiles in position
order, each row's online softmax stopping at its own position, the query heads of one KV head
stacked into one tile. Beside it,
``csrc/rope.cpp`` rotates keys and queries in place in one pass (torch takes five) and
``csrc/rms_norm.cpp`` is HF's Llama RMSNorm in one pass (torch takes six); both give HF's
values bit for bit, and a decode step's attention for a batch of requests in AVX512-BF16 dot
products (``csrc/decode_attention_bf16.cpp``, :mod:`ragblend.kernels.cpu.decode_kernels`). That
build is for bf16 on CPUs at the ``avx512_bf16`` level or above (:mod:`ragblend.cpu`).
A second build, for fp32 on any CPU at the ``avx2`` level or above, has the same selected-row
attention through BLAS sgemm tiles (``csrc/rows_attention_f32.cpp``), the same one-pass RoPE
and RMSNorm (``csrc/rope_f32.cpp``, ``csrc/rms_norm_f32.cpp``), HF's fp32 values bit for bit
(both norms sum in torch's order, ``csrc/torch_sum_order.h``), and a decode step's attention
for a batch of requests, each over its own K/V buffer (``csrc/decode_attention_f32.cpp``: the
layer-wise decoder's one call per layer instead of SDPA per request; 16 lanes wide at the
``avx512`` level). Elsewhere (fp16, CUDA, a
sliding window, a CPU below the build's level) the SDPA blocks and HF's modules run.

``row_attention="auto"`` (the default) uses the kernels where they apply and warns once when a
CPU that could run them cannot build them (no C++ compiler); ``"native"`` raises instead;
``"sdpa"`` never uses them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch

from ragblend import cpu
from ragblend.errors import RagblendError
from ragblend.kernels.cpu.decode_kernels import DECODE_512, DecodeKernel, decode_kernel, load_512
from ragblend.kernels.cpu.extensions import ATEN_AVX512, AVX512, load_ops

log = logging.getLogger(__name__)

RowAttention = Literal["auto", "native", "sdpa", "masked"]
ROW_ATTENTION: tuple[str, ...] = get_args(RowAttention)


@dataclass(frozen=True)
class Build:
    """One compiled extension: its sources, the CPU level and flags it is compiled for, the
    dtype its kernels take and the head dims they handle (multiples of ``head_multiple``)."""

    name: str
    sources: tuple[str, ...]
    level: str
    flags: tuple[str, ...]
    dtype: torch.dtype
    head_multiple: int


# at::parallel_for's OpenMP pragmas; the runtime is torch's own libgomp, already loaded
_OPENMP = "-fopenmp"
BUILDS = {
    torch.bfloat16: Build(
        "ragblend_native",
        ("rows_attention.cpp", "rope.cpp", "rms_norm.cpp", "decode_attention_bf16.cpp"),
        "avx512_bf16",
        # bf16 tile matmuls through ATen's brgemm (AMX, else AVX512-BF16), AVX512 code around
        ("-O3", *ATEN_AVX512, *AVX512, "-mavx512bf16", "-mfma", _OPENMP),
        torch.bfloat16,
        32,
    ),
    torch.float32: Build(
        "ragblend_native_f32",
        ("rows_attention_f32.cpp", "rope_f32.cpp", "rms_norm_f32.cpp", "decode_attention_f32.cpp"),
        "avx2",
        # at::vec's 8-lane AVX2 code; no FMA contraction: the RoPE's products round as HF's
        (
            "-O3",
            "-DCPU_CAPABILITY_AVX2",
            "-DCPU_CAPABILITY=AVX2",
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-ffp-contract=off",
            _OPENMP,
        ),
        torch.float32,
        16,
    ),
}

# q [1, H, m, d], k [1, Hkv, N, d], v [1, Hkv, N, d], positions [m] int64, scale -> [1, m, H*d]
RowKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# k [1, Hkv, N, d] rotated in place (and returned), cos, sin [1, N, d]
RopeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# x [..., D] contiguous, weight [D], eps -> a new tensor like x
NormKernel = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


class NativeKernels(NamedTuple):
    """The compiled kernels for one ``dtype``: selected-row attention, in-place RoPE,
    Llama's RMSNorm (``None`` where there is none for the dtype, or it does not match this
    torch's bit for bit, see ``_rms_norm_if_exact``) and a decode step's attention for a
    batch of requests (q and K/V of ``dtype``, fp32's also over bf16 K/V; ``None`` where the
    bf16 one fails its check, :mod:`ragblend.kernels.cpu.decode_kernels`)."""

    attend_rows: RowKernel
    rope_: RopeKernel
    rms_norm: NormKernel | None = None
    dtype: torch.dtype = torch.bfloat16
    decode_attend: DecodeKernel | None = None


def check_row_attention(choice: str) -> str:
    """``choice`` if it is a ``row_attention`` value, else a RagblendError naming them."""
    if choice not in ROW_ATTENTION:
        raise RagblendError(
            f"unknown row_attention {choice!r}; expected one of {', '.join(ROW_ATTENTION)}"
        )
    return choice


def cpu_runs_kernel(dtype: torch.dtype = torch.bfloat16) -> bool:
    """True when the CPU level (:func:`ragblend.cpu.cpu_isa`) is at least the level the
    kernels for ``dtype`` are compiled for (bf16: ``avx512_bf16``; fp32: ``avx2``)."""
    build = BUILDS.get(dtype)
    return build is not None and cpu.isa_at_least(build.level)


def build_kernels(dtype: torch.dtype = torch.bfloat16) -> NativeKernels:
    """Compile (or load the cached build of) the kernels for ``dtype``; RagblendError says
    why they cannot."""
    build = BUILDS.get(dtype)
    if build is None:
        raise RagblendError(f"ragblend has no native kernels for {dtype}")
    if not cpu_runs_kernel(dtype):
        raise RagblendError(
            f"ragblend's native {dtype} kernels need CPU level {build.level}; this CPU is at "
            f"level {cpu.cpu_isa()} ({cpu.cpu_model()})"
        )
    built = _BUILT.get(dtype)
    if built is None:  # built once per process; a failing build fails the same way each time
        try:
            built = _compiled(dtype)
        except RagblendError as exc:
            built = exc
        _BUILT[dtype] = built
    if isinstance(built, RagblendError):
        raise built
    return built


def decode_builds() -> dict[str, tuple[DecodeKernel, torch.dtype]]:
    """Every build of the decode attention this CPU level runs, by name (``fp32_avx2``,
    ``fp32_avx512``, ``bf16_dpbf16``), each with the dtype its q takes: for tests and
    benchmarks that compare them (a model decodes with its kernels' ``decode_attend``)."""
    builds: dict[str, tuple[DecodeKernel, torch.dtype]] = {}
    if cpu_runs_kernel(torch.float32):
        build_kernels(torch.float32)
        builds["fp32_avx2"] = (torch.ops.ragblend_native_f32.decode_attend, torch.float32)
    if cpu.isa_at_least(DECODE_512.level):
        builds["fp32_avx512"] = (load_512(), torch.float32)
    if cpu_runs_kernel(torch.bfloat16):
        build_kernels(torch.bfloat16)
        builds["bf16_dpbf16"] = (torch.ops.ragblend_native.decode_attend, torch.bfloat16)
    return builds


_BUILT: dict[torch.dtype, NativeKernels | RagblendError] = {}  # the kernels, or why not
_WARNED: set[str] = set()


def _compiled(dtype: torch.dtype) -> NativeKernels:
    build = BUILDS[dtype]
    log.info("loading ragblend's native %s kernels (compiled once per machine)", dtype)
    try:
        ops = load_ops(build.name, build.sources, build.flags)
    except Exception as exc:  # compiler missing or failing: the message says which
        raise RagblendError(f"could not build ragblend's native kernels: {exc}") from exc
    _check_rows(ops.attend_rows, ops.rope_, dtype)
    norm = _rms_norm_if_exact(ops.rms_norm, dtype)
    return NativeKernels(ops.attend_rows, ops.rope_, norm, dtype, decode_kernel(ops, dtype))


# the row attention's tolerance against SDPA in float32 over the same inputs, per dtype
_ROWS_TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 2e-2)}


def _check_rows(attend: RowKernel, rope_: RopeKernel, dtype: torch.dtype) -> None:
    """RagblendError unless the kernels give HF's RoPE bit for bit and SDPA's attention, on
    random ``dtype`` inputs: to fp32 rounding in fp32 (the attention's sgemm is the BLAS inside
    torch's CPU library, whose behaviour ragblend does not control), to bf16 rounding of the
    fp32 result in bf16 (oneDNN's brgemm micro-kernel: AMX tiles, or AVX512-BF16 dot products
    where the CPU has no AMX; a CPU where oneDNN has neither fails here)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 300, 32, generator=gen).to(dtype) for _ in range(2))
    cos, sin = (t.to(dtype) for t in torch.randn(2, 1, 300, 32, generator=gen))
    want = apply_rotary_pos_emb(k, k, cos, sin)[0]
    if not torch.equal(rope_(k.clone(), cos, sin), want):
        raise RagblendError(f"the native {dtype} RoPE does not match HF's bit for bit")
    positions = torch.randperm(300, generator=gen)[:70].sort().values
    q = torch.randn(1, 4, 70, 32, generator=gen).to(dtype)
    mask = torch.arange(300).view(1, -1) <= positions.view(-1, 1)  # causal by position
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask, scale=0.2, enable_gqa=True
    )
    try:
        got = attend(q, k, v, positions, 0.2).float()
    except RuntimeError as exc:  # oneDNN without a bf16 brgemm for this CPU
        raise RagblendError(f"the native {dtype} row attention cannot run here: {exc}") from exc
    atol, rtol = _ROWS_TOLERANCE[dtype]
    if not torch.allclose(got, ref.transpose(1, 2).reshape(1, 70, -1), atol=atol, rtol=rtol):
        raise RagblendError(f"the native {dtype} row attention does not match SDPA's")


def _rms_norm_if_exact(
    kernel: NormKernel, dtype: torch.dtype = torch.bfloat16
) -> NormKernel | None:
    """``kernel`` if it equals HF's ``LlamaRMSNorm`` bit for bit on random rows of a few
    widths, else None with a warning. The kernel sums the squares in the order of torch's CPU
    sum kernel, which a torch other than the one ragblend pins could change."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    for width in (576, 1000, 4096):
        norm = LlamaRMSNorm(width, eps=1e-6).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(width, generator=gen) * 0.3 + 1)
            x = (torch.randn(33, width, generator=gen) * 20).to(dtype)
            exact = torch.equal(kernel(x, norm.weight, norm.variance_epsilon), norm(x))
        if not exact:
            log.warning(
                "ragblend's native RMSNorm does not match torch %s bit for bit; "
                "the fusor uses HF's RMSNorm",
                torch.__version__,
            )
            return None
    return kernel


def native_kernels(
    choice: str, dtype: torch.dtype, device: torch.device, head_dim: int
) -> NativeKernels | None:
    """The native kernels for a model with this dtype, device and head dim, or ``None`` for
    SDPA blocks and HF's RoPE and RMSNorm. ``choice`` is ``"auto"``, ``"native"``
    (RagblendError when they cannot run), ``"sdpa"`` or ``"masked"`` (both: no kernels)."""
    if check_row_attention(choice) in ("sdpa", "masked"):
        return None
    build = BUILDS.get(dtype) if device.type == "cpu" else None
    if build is None or head_dim % build.head_multiple:
        if choice == "native":
            raise RagblendError(
                "row_attention='native' runs float32 models (head dim a multiple of 16) and "
                "bf16 models (a multiple of 32) on CPU; this model is "
                f"{dtype} on {device.type}, head dim {head_dim}"
            )
        return None
    if choice == "auto" and not cpu_runs_kernel(dtype):
        return None
    try:
        return build_kernels(dtype)
    except RagblendError as exc:
        if choice == "native":
            raise
        if str(exc) not in _WARNED:  # once per reason and process, not once per engine
            _WARNED.add(str(exc))
            log.warning("%s; selected rows attend through SDPA blocks instead", exc)
        return None
