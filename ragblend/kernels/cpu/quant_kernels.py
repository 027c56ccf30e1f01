"""Native CPU kernels that read GGUF quantized weight blocks in place (compiled on first use).

A quantized weight is ggml's blocks as a GGUF file stores them: a uint8 tensor
``[rows, row_bytes]`` (``gguf.GGUFReader(...).tensors[i].data``), each row ``cols`` weights in
``cols / block_elems`` consecutive blocks of one of :data:`QUANT_TYPES`.
``ragblend/kernels/cpu/csrc/quant_blocks.cpp`` (built for AVX2 + FMA + F16C, for AVX512 where the
CPU level has it: a matmul twice as wide, and for AVX512-BF16: a bf16 matmul in ``vdpbf16ps``)
has three ops on them:

- ``dequantize(blocks, qtype, cols, dtype) -> [rows, cols]``: float32 values equal to the gguf
  package's ``gguf.dequantize`` bit for bit (the same float32 products and sums in the same
  order), or those values rounded to bfloat16 as ``.to(torch.bfloat16)`` rounds them.
- ``matmul(x [n, cols], blocks, qtype, cols, bias [rows] | None) -> [n, rows]``:
  ``x @ dequantize(blocks).T (+ bias)`` to float32 rounding for ``1 <= n <=`` :data:`MAX_ROWS`,
  reading each weight block once for all n rows (a decode step's projection). Each output row
  is the same bit for bit whatever n (a request decoded in a batch gets what it gets alone).
  x and the output are float32 or both bf16 (the bias either). In bf16, below the
  ``avx512_bf16`` build: bit for bit the float32 call on ``x.float()`` and ``bias.float()``
  rounded ``.to(torch.bfloat16)``, without those conversions' own calls. In the
  ``avx512_bf16`` build (``QuantKernels.bf16_products``): x times the weights rounded to
  bf16 (``dequantize(..., torch.bfloat16)``, what a dequantized bf16 model multiplies), by
  ``vdpbf16ps``, products summed in float32 (bf16 subnormal inputs read as zero), the bias
  added and the result rounded to bf16: ``F.linear`` on those bf16 weights within
  :func:`ragblend.kernels.cpu.dense_decode.tolerance`, as the dense bf16 decode kernel gives; at
  8 rows of x 1.6-1.8x the float32 products' speed (half the multiply instructions), at one
  row 0.94-1.16x (Q4_1 slower, Q6_K and Q8_0 as fast, Q4_K and Q5_0 faster; Zen 5).
- ``matmul_cat(x, [blocks, ...], [qtype, ...], cols, [bias | None, ...]) -> [n, sum of rows]``:
  ``matmul`` of several weights of any types (an attention's q/k/v, an MLP's gate/up) in one
  call, their outputs side by side, each one's values what ``matmul`` gives it alone.

:func:`quant_kernels` builds them once per process, for the highest of :data:`BUILDS` the CPU
level allows (:mod:`ragblend.cpu`), and checks them on random blocks of every type against
:func:`dequantize_reference` (the gguf package, also the fallback) before use. A wider build that
fails falls back to the next with one warning; ``None`` (with one warning per process) where the
CPU is below the ``avx2`` level or the AVX2 build or a check fails. Each build's rows are the
same alone and batched; the AVX512 build sums in another order than the AVX2 one (both to
float32 rounding of the dense result), and the AVX512-BF16 build's bf16 outputs may differ
from theirs by the weights' rounding to bf16.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from ragblend import cpu
from ragblend.kernels.cpu.extensions import AVX512, Build, load_ops, widest_that_loads

log = logging.getLogger(__name__)

QUANT_TYPES: dict[int, str] = {
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
}
MAX_ROWS = 16  # rows of x per matmul call
AVX2_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp")


# widest first; quant_kernels() takes the first one the CPU level allows that builds and checks
BUILDS: tuple[Build, ...] = (
    Build(
        "avx512_bf16",
        "ragblend_quant512bf16",
        (*AVX2_FLAGS, *AVX512, "-mavx512bf16")
        + ("-DRAGBLEND_QUANT_512", "-DRAGBLEND_QUANT_BF16")
        + ("-DRAGBLEND_QUANT_NS=ragblend_quant512bf16",),
    ),
    Build(
        "avx512",
        "ragblend_quant512",
        (*AVX2_FLAGS, *AVX512) + ("-DRAGBLEND_QUANT_512", "-DRAGBLEND_QUANT_NS=ragblend_quant512"),
    ),
    Build("avx2", "ragblend_quant", AVX2_FLAGS),
)
LEVEL = BUILDS[-1].level  # the least the kernels need

# byte offsets, within a block, of the f16 fields that scale it (d, and m / dmin)
SCALE_FIELDS: dict[int, tuple[int, ...]] = {
    2: (0,),
    3: (0, 2),
    6: (0,),
    7: (0, 2),
    8: (0,),
    12: (0, 2),
    13: (0, 2),
    14: (208,),
}


class QuantKernels(NamedTuple):
    """The compiled ops. ``dequantize(blocks, qtype, cols, dtype)``: uint8 ``[rows,
    row_bytes]`` -> ``[rows, cols]`` in ``dtype`` (float32 or bfloat16).
    ``matmul(x, blocks, qtype, cols, bias)``: float32 or bf16 x ``[n, cols]`` (contiguous,
    n <= 16), bias float32 or bf16 ``[rows]`` or None -> ``[n, rows]`` in x's dtype.
    ``matmul_cat(x, [blocks...], [qtype...], cols, [bias...])``: the same for several weights
    of any types in one call, their outputs side by side ``[n, sum of rows]``, each one's
    values what ``matmul`` gives for it. ``bf16_products``: whether bf16 x multiplies the
    weights rounded to bf16 (the ``avx512_bf16`` build) rather than their float32 values."""

    dequantize: Callable[[torch.Tensor, int, int, torch.dtype], torch.Tensor]
    matmul: Callable[[torch.Tensor, torch.Tensor, int, int, torch.Tensor | None], torch.Tensor]
    matmul_cat: Callable[
        [torch.Tensor, list[torch.Tensor], list[int], int, list[torch.Tensor | None]],
        torch.Tensor,
    ]
    level: str  # the CPU level of the build these are
    bf16_products: bool = False


def block_shape(qtype: int) -> tuple[int, int]:
    """(weights, bytes) of one block of ggml type ``qtype``."""
    import gguf

    elems, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    return int(elems), int(size)


def dequantize_reference(blocks: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
    """float32 ``[rows, cols]`` from uint8 blocks ``[rows, row_bytes]`` through
    ``gguf.dequantize`` (numpy): the fallback and the kernels' oracle."""
    import gguf

    data = blocks.contiguous().numpy()
    values = gguf.dequantize(data, gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(values.reshape(blocks.shape[0], cols).copy())


def random_blocks(rows: int, cols: int, qtype: int, generator: torch.Generator) -> torch.Tensor:
    """Valid random blocks, uint8 ``[rows, row_bytes]``: random bytes, with every f16 scale
    field (d, m / dmin) a finite value of magnitude in [1e-3, 5e-2] and a random sign."""
    elems, size = block_shape(qtype)
    if cols % elems:
        raise ValueError(f"cols {cols} is not a multiple of {QUANT_TYPES[qtype]}'s {elems}")
    nblocks = cols // elems
    data = torch.randint(0, 256, (rows, nblocks, size), generator=generator, dtype=torch.uint8)
    for offset in SCALE_FIELDS[qtype]:
        magnitude = torch.rand(rows, nblocks, generator=generator) * 0.049 + 0.001
        sign = torch.randint(0, 2, (rows, nblocks), generator=generator) * 2 - 1
        scale = (magnitude * sign).to(torch.float16).view(torch.uint8).view(rows, nblocks, 2)
        data[:, :, offset : offset + 2] = scale
    return data.reshape(rows, nblocks * size)


def quant_kernels() -> QuantKernels | None:
    """The checked kernels of the widest build the CPU level allows, built once per process;
    None where the CPU is below the ``avx2`` level or the AVX2 build or a check fails (one
    warning per process says why; a wider build's failure is one warning too)."""
    global _BUILT
    if _BUILT is None:
        _BUILT = _first_build()
    return _BUILT if isinstance(_BUILT, QuantKernels) else None


_BUILT: QuantKernels | str | None = None  # the kernels, or why not


def _first_build() -> QuantKernels | str:
    if not cpu.isa_at_least(LEVEL):
        why = f"they need CPU level {LEVEL}; this CPU is at {cpu.cpu_isa()} ({cpu.cpu_model()})"
        log.warning("ragblend's native quantized-weight kernels are off: %s", why)
        return why
    try:
        built = widest_that_loads(
            BUILDS, _build, lambda b: cpu.isa_at_least(b.level), "quantized-weight kernels", log
        )
    except Exception as exc:  # compiler missing or failing, or a check: the message says
        log.warning("ragblend's native quantized-weight kernels are off: %s", exc)
        return str(exc)
    assert built is not None, "the last build is the least level"
    return built


def kernels_of(level: str) -> QuantKernels:
    """The checked kernels of the build for CPU level ``level`` (one of :data:`BUILDS`), built
    (or loaded) now: for benchmarks that compare builds in one process. Raises ValueError for
    an unknown level or one above the CPU's, and whatever the build or its check raises."""
    build = next((b for b in BUILDS if b.level == level), None)
    if build is None:
        raise ValueError(
            f"no quantized-kernel build for level {level!r}: {[b.level for b in BUILDS]}"
        )
    if not cpu.isa_at_least(level):
        raise ValueError(f"the {level} build needs that CPU level; this CPU is at {cpu.cpu_isa()}")
    return _build(build)


@contextmanager
def kernels_in_use(kernels: QuantKernels) -> Iterator[None]:
    """Within the block, :func:`quant_kernels` gives ``kernels`` (e.g. :func:`kernels_of`'s)
    to every quantized linear, loaded before or after: for benchmarks that compare builds on
    one loaded model, interleaved."""
    global _BUILT
    before = _BUILT
    _BUILT = kernels
    try:
        yield
    finally:
        _BUILT = before


def _build(build: Build) -> QuantKernels:
    log.info("loading ragblend's %s quantized-weight kernels (compiled once)", build.level)
    ops = load_ops(build.name, ["quant_blocks.cpp"], build.flags)
    bf16_products = "-DRAGBLEND_QUANT_BF16" in build.flags
    kernels = QuantKernels(ops.dequantize, ops.matmul, ops.matmul_cat, build.level, bf16_products)
    for qtype in QUANT_TYPES:
        _check(kernels, qtype)
    _check_cat(kernels)
    return kernels


def matmul_tolerance(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-output bound ``[n, rows]`` on a matmul's float32 rounding error: 1e-4 of
    ``|x| @ |weight|.T`` plus 1e-6 (x ``[n, cols]``, weight ``[rows, cols]``)."""
    return x.abs() @ weight.abs().T * 1e-4 + 1e-6


def _check(kernels: QuantKernels, qtype: int) -> None:
    """RuntimeError unless, on random blocks of ``qtype``, dequantize equals gguf's bit for bit
    (float32, and bf16 as float32 rounded), matmul equals ``x @ ref.T + bias`` to float32
    rounding, each row of a batched matmul equals the same row alone bit for bit, and bf16 x
    and bias give the float32 call's output rounded to bf16 bit for bit (with
    ``bf16_products``: ``F.linear`` on the weights rounded to bf16 within
    :func:`ragblend.kernels.cpu.dense_decode.tolerance`, each row alone as batched)."""
    name = QUANT_TYPES[qtype]
    gen = torch.Generator().manual_seed(qtype)
    blocks = random_blocks(7, 512, qtype, gen)
    ref = dequantize_reference(blocks, qtype, 512)
    got = kernels.dequantize(blocks, qtype, 512, torch.float32)
    if not torch.equal(got, ref):
        raise RuntimeError(f"{name} dequantize does not match gguf's bit for bit")
    if not torch.equal(kernels.dequantize(blocks, qtype, 512, torch.bfloat16), ref.bfloat16()):
        raise RuntimeError(f"{name} bf16 dequantize does not match gguf's rounded to bf16")
    x = torch.randn(5, 512, generator=gen)
    bias = torch.randn(7, generator=gen)
    batched = kernels.matmul(x, blocks, qtype, 512, bias)
    if not bool(((batched - (x @ ref.T + bias)).abs() <= matmul_tolerance(x, ref)).all()):
        raise RuntimeError(f"{name} matmul does not match x @ dequantize(w).T")
    for i in range(x.shape[0]):
        alone = kernels.matmul(x[i : i + 1], blocks, qtype, 512, bias)
        if not torch.equal(alone[0], batched[i]):
            raise RuntimeError(f"{name} matmul gives a row in a batch other than alone")
    x16, bias16 = x.bfloat16(), bias.bfloat16()
    got = kernels.matmul(x16, blocks, qtype, 512, bias16)
    if kernels.bf16_products:
        _check_bf16_products(kernels, qtype, blocks, x16, bias16, got)
        return
    want = kernels.matmul(x16.float(), blocks, qtype, 512, bias16.float()).bfloat16()
    if not torch.equal(got, want):
        raise RuntimeError(f"{name} bf16 matmul is not the float32 one rounded to bf16")


def _check_bf16_products(
    kernels: QuantKernels,
    qtype: int,
    blocks: torch.Tensor,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    got: torch.Tensor,
) -> None:
    """RuntimeError unless ``got``, the ``bf16_products`` matmul of bf16 ``x [n, cols]``,
    is ``F.linear`` on the weights rounded to bf16 within
    :func:`~ragblend.kernels.cpu.dense_decode.tolerance`, and each of its rows is the same alone."""
    from ragblend.kernels.cpu.dense_decode import tolerance

    name, cols = QUANT_TYPES[qtype], x.shape[1]
    weight = kernels.dequantize(blocks, qtype, cols, torch.bfloat16)
    want = torch.nn.functional.linear(x, weight, bias)
    if not bool(((got.float() - want.float()).abs() <= tolerance(x, weight, got, want)).all()):
        raise RuntimeError(f"{name} bf16 matmul does not match F.linear on bf16 weights")
    for i in range(x.shape[0]):
        if not torch.equal(kernels.matmul(x[i : i + 1], blocks, qtype, cols, bias)[0], got[i]):
            raise RuntimeError(f"{name} bf16 matmul gives a row in a batch other than alone")


def _check_cat(kernels: QuantKernels) -> None:
    """RuntimeError unless matmul_cat over weights of three types (one with a bias) gives
    each one's matmul side by side, bit for bit, in float32 and bf16."""
    gen = torch.Generator().manual_seed(99)
    qtypes = [6, 8, 12]  # Q5_0, Q8_0, Q4_K: as a Qwen2.5 file's q, v and a K-quant's
    blocks = [random_blocks(rows, 512, q, gen) for rows, q in zip((70, 9, 33), qtypes)]
    biases = [torch.randn(70, generator=gen), None, None]
    for x in (torch.randn(3, 512, generator=gen), torch.randn(2, 512, generator=gen).bfloat16()):
        parts = [kernels.matmul(x, b, q, 512, c) for b, q, c in zip(blocks, qtypes, biases)]
        if not torch.equal(kernels.matmul_cat(x, blocks, qtypes, 512, biases), torch.cat(parts, 1)):
            raise RuntimeError("matmul_cat is not each weight's matmul side by side")
