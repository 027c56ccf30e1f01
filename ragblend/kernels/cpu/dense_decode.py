"""A native bf16 matmul for a decode step's few rows, each row's output the same in any batch.

``ragblend/kernels/cpu/csrc/dense_bf16.cpp`` (compiled on first use, in one of :data:`BUILDS`) has
two ops on bf16 CPU tensors:

- ``matmul(x [n, cols], weight [rows, cols], bias [rows] | None) -> [n, rows]``: ``F.linear``'s
  result for ``1 <= n <=`` :data:`MAX_ROWS`, reading each weight row once for all n rows;
- ``matmul_cat(x, weights, biases) -> [n, sum of rows]``: the same over several weights of one
  input (a layer's q/k/v, gate/up) into one output, without stacking (copying) them.

x and the weights are contiguous and ``cols`` is a multiple of :data:`COLS_MULTIPLE` (other
weights stay on their current path: :func:`supports`). bf16 values widen to fp32 exactly and
their products are exact in fp32; each (x row, weight row) pair sums in its own fp32
accumulators over the columns in a fixed order, then adds the bias and rounds to bf16 as torch
does. So each row's output is the same bit for bit whatever the rows beside it (a request
decoded in a batch gets what it gets alone), and it differs from ``F.linear``'s only where
another fp32 summation order flips a bf16 rounding.

The builds, widest first: at the ``avx512_bf16`` level the products and their pairwise sums
are AVX512-BF16's ``vdpbf16ps`` on the bf16 values as they are (32 columns per instruction,
half the work of widening), which treats bf16 subnormal inputs (below 2^-126) as zero and
flushes subnormal results to zero, as oneDNN's bf16 kernel on such CPUs does; at ``avx512``
the values widen to fp32 and sum in fp32 FMAs (exact products, subnormals kept). The two
builds sum in different orders, so their outputs may differ by a flipped bf16 rounding; each
build's rows are the same alone and batched.

:func:`dense_kernel` builds the ops once per process and level, for the widest build the CPU
level (:mod:`ragblend.cpu`, capped by ``RAGBLEND_CPU_ISA``) allows, ``avx512`` at least, and
checks them before use on random
data (n = 1, 3, 16; cols 576, 1536, 4096) against ``F.linear`` within :func:`tolerance` — one
bf16 ulp, plus fp32's own rounding bound where the sum cancels — and each row alone against
the same row batched, bit for bit. A wider build that fails to compile or check falls back to
the next with one warning saying why; where the ``avx512`` build fails too, one warning and
None: decode linears then stay on oneDNN's one-row path (:mod:`ragblend.models.packed`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ragblend import cpu
from ragblend.kernels.cpu.extensions import AVX512, Build, load_ops

log = logging.getLogger(__name__)

MAX_ROWS = 16  # rows of x per call
COLS_MULTIPLE = 32  # the kernel reads 32 bf16 weights (one cache line) at a time
FLAGS = ("-O3", *AVX512, "-mfma", "-ffp-contract=off", "-fopenmp")


# widest first; dense_kernel() takes the first one the CPU level allows that builds and checks
BUILDS: tuple[Build, ...] = (
    Build(
        "avx512_bf16",
        "ragblend_dense_dpbf16",
        (*FLAGS, "-mavx512bf16", "-DRAGBLEND_DENSE_DPBF16")
        + ("-DRAGBLEND_DENSE_NS=ragblend_dense_dpbf16",),
    ),
    Build("avx512", "ragblend_dense", FLAGS),
)
LEVEL = BUILDS[-1].level  # the CPU level the kernel needs
CHECK_SHAPES = ((1, 576), (3, 1536), (16, 4096))  # (n, cols) of the load-time check


class DenseKernel(NamedTuple):
    """The compiled ops (see the module docstring). ``matmul(x, weight, bias)``: x ``[n,
    cols]``, weight ``[rows, cols]``, bias ``[rows]`` or None -> ``[n, rows]``;
    ``matmul_cat(x, weights, biases)`` -> ``[n, sum of rows]``; all bf16."""

    matmul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    matmul_cat: Callable[
        [torch.Tensor, Sequence[torch.Tensor], Sequence[torch.Tensor | None]], torch.Tensor
    ]
    level: str  # the CPU level of the build these are


# build name -> its checked kernel, or why not (each build tried once per process)
_BUILT: dict[str, DenseKernel | str] = {}


def dense_kernel(level: str | None = None) -> DenseKernel | None:
    """The checked kernel of the widest build that ``level`` (default: the CPU level,
    :func:`ragblend.cpu.cpu_isa`, as it reads now; never above it) allows, each build built
    once per process; None below the ``avx512`` level or where every build allowed failed to
    build or check (one warning per failed build and process says why)."""
    if level is None or cpu.LEVELS.index(level) > cpu.LEVELS.index(cpu.cpu_isa()):
        level = cpu.cpu_isa()
    allowed = [b for b in BUILDS if cpu.LEVELS.index(b.level) <= cpu.LEVELS.index(level)]
    for build in allowed:
        if build.name not in _BUILT:
            try:
                _BUILT[build.name] = _build(build)
            except Exception as exc:  # compiler missing or failing, or the check: it says
                if build is BUILDS[-1]:
                    log.warning("ragblend's native bf16 decode matmul is off: %s", exc)
                else:
                    log.warning(
                        "ragblend's %s native bf16 decode matmul is off (%s); using the next build",
                        build.level,
                        exc,
                    )
                _BUILT[build.name] = str(exc)
        built = _BUILT[build.name]
        if isinstance(built, DenseKernel):
            return built
    return None


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel takes ``weight`` as it is: a contiguous 2-D bf16 CPU tensor whose
    columns are a multiple of :data:`COLS_MULTIPLE`."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.shape[1] % COLS_MULTIPLE == 0
    )


def tolerance(x: torch.Tensor, weight: torch.Tensor, got: torch.Tensor, want: torch.Tensor):
    """Per-output bound ``[n, rows]`` on ``|got - want|`` for two bf16 results of ``x [n,
    cols] @ weight [rows, cols].T`` summed in different fp32 orders: one bf16 ulp of the larger
    of the two (a flipped rounding), plus 2^-16 of ``|x| @ |weight|.T`` (the two fp32 sums'
    own rounding, which only shows where the sum cancels to far below its terms)."""
    big = torch.maximum(got.float().abs(), want.float().abs())
    _, exponent = torch.frexp(big)  # big = m * 2^e, 0.5 <= m < 1: a bf16 ulp is 2^(e - 8)
    ulp = torch.ldexp(torch.ones_like(big), exponent - 8)
    return ulp + (x.float().abs() @ weight.float().abs().T) * 2.0**-16


def _build(build: Build) -> DenseKernel:
    log.info("loading ragblend's %s native bf16 decode matmul (compiled once)", build.level)
    ops = load_ops(build.name, ["dense_bf16.cpp"], build.flags)
    kernel = DenseKernel(ops.matmul, ops.matmul_cat, build.level)
    _check(kernel)
    return kernel


def _check(kernel: DenseKernel) -> None:
    """RuntimeError unless, on random bf16 data of :data:`CHECK_SHAPES` (with a bias, and a
    row count that is no multiple of the kernel's tiles), every output is within
    :func:`tolerance` of ``F.linear``'s and each row alone equals the same row batched."""
    gen = torch.Generator().manual_seed(0)
    for n, cols in CHECK_SHAPES:
        x = torch.randn(n, cols, generator=gen).bfloat16()
        weight = (torch.randn(67, cols, generator=gen) / cols**0.5).bfloat16()
        bias = torch.randn(67, generator=gen).bfloat16()
        for b in (None, bias):
            got, want = kernel.matmul(x, weight, b), F.linear(x, weight, b)
            if not bool(
                ((got.float() - want.float()).abs() <= tolerance(x, weight, got, want)).all()
            ):
                raise RuntimeError(
                    f"matmul [{n}, {cols}] does not match F.linear within a bf16 ulp"
                )
            for i in range(n):
                if not torch.equal(kernel.matmul(x[i : i + 1], weight, b)[0], got[i]):
                    raise RuntimeError("matmul gives a row in a batch other than alone")
        cat = kernel.matmul_cat(x, [weight, weight[:5]], [bias, None])
        if not torch.equal(cat, torch.cat([got, kernel.matmul(x, weight[:5], None)], dim=1)):
            raise RuntimeError("matmul_cat differs from its weights' matmuls side by side")
