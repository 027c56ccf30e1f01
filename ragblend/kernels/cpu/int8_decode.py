"""8-bit activations for a decode step's quantized linears (``BlendConfig.decode_activations``).

llama.cpp multiplies a GGUF's quantized weights by activations quantized to 8 bits per block
and integer dot products; the same file in Ollama, LM Studio or llama.cpp decodes that way.
With ``decode_activations="int8"`` ragblend does the same for decode steps — the arithmetic of
:mod:`ragblend.kernels.cpu.int8_reference` (its oracle), run by ``csrc/quant_int8.cpp``'s kernels
(AVX2 ``vpmaddubsw`` / ``vpmaddwd``, or AVX512-VNNI ``vpdpbusd`` / ``vpdpwssd`` where the CPU
has it: :data:`BUILDS`, the same floats bit for bit) — and keeps prefills on the exact path
(dequantize + ``F.linear``). ``"float"`` is the exact path everywhere; ``"auto"`` picks per CPU
level from :data:`AUTO_BY_LEVEL`, measured.

Only decode steps use it: :func:`step_activations` marks the thread while one runs with the
decoder's setting (``ragblend.decode.decoder.decode_batch`` and the HF-forward decoder enter it),
and a :class:`~ragblend.models.quantized.QuantLinear` takes the int8 kernel only inside an int8
step. The setting belongs to the decoder (an engine view's config), not to the model. The
kernels are built once per process and checked on random blocks of every type against the
reference (to float32 rounding of its per-block terms; each row the same alone and batched);
where they cannot run, ``"int8"`` falls back to ``"float"`` with one warning saying why.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ragblend import cpu
from ragblend.errors import RagblendError
from ragblend.kernels.cpu import int8_reference as ref
from ragblend.kernels.cpu.extensions import AVX512, Build, load_ops, widest_that_loads
from ragblend.kernels.cpu.quant_kernels import AVX2_FLAGS, QUANT_TYPES, random_blocks

log = logging.getLogger(__name__)

# widest first; int8_kernels() takes the first one this CPU runs that builds and checks. The
# VNNI build (vpdpbusd / vpdpwssd on 256-bit lanes) gives the AVX2 build's floats bit for bit;
# the AMX build (AMX-INT8 tiles for Q4_1 and Q8_0, the VNNI code for the other types) gives
# those two types' per-block terms in another float32 order: the same to float32 rounding.
_VNNI_FLAGS = (*AVX2_FLAGS, *AVX512, "-mavx512vnni", "-DRAGBLEND_Q8_VNNI")
BUILDS: tuple[Build, ...] = (
    Build(
        "amx",
        "ragblend_q8amx",
        (*_VNNI_FLAGS, "-mamx-tile", "-mamx-int8", "-DRAGBLEND_Q8_AMX")
        + ("-DRAGBLEND_Q8_NS=ragblend_q8amx",),
    ),
    Build("avx512", "ragblend_q8vnni", (*_VNNI_FLAGS, "-DRAGBLEND_Q8_NS=ragblend_q8vnni")),
    Build("avx2", "ragblend_q8", AVX2_FLAGS),
)
# /proc/cpuinfo flags a build needs beyond its CPU level
EXTRA_FLAGS: dict[str, frozenset[str]] = {
    "ragblend_q8amx": frozenset({"avx512_vnni", "amx_int8"}),
    "ragblend_q8vnni": frozenset({"avx512_vnni"}),
}
LEVEL = BUILDS[-1].level  # the least the kernels need


@dataclass(frozen=True)
class AutoActivations:
    """What ``decode_activations="auto"`` picks at one CPU level, and what it rests on."""

    mode: str  # "float" or "int8"
    measured: str  # the CPU, date and benchmark the choice comes from
    why: str


AUTO_BY_LEVEL: dict[str, AutoActivations] = {
    "baseline": AutoActivations("float", "not measured", "the int8 kernels need AVX2"),
    "avx2": AutoActivations(
        "int8",
        "AMD EPYC Zen 3, 2026-11-27, benchmarks/decode_vs_llamacpp.py and decode_steps.py "
        "(amd-avx2/decode_vs_llamacpp_int8.json, decode_steps_numerics.json)",
        "Q4_K_M decode vs llama.cpp's AVX2 build: 3B 1.17x (float 0.72x), 8B 1.12x (0.72x); "
        "the embedded model's steps 4-10 % shorter at 1, 4 and 8 requests",
    ),
    "avx512": AutoActivations(
        "int8",
        "Intel Xeon with AMX-BF16 and AVX512-VNNI capped at avx512, 2026-11-28, "
        "benchmarks/decode_vs_llamacpp.py (intel-amx/decode_vs_llamacpp_int8_capped.json)",
        "Llama-3.2-3B Q4_K_M decode vs llama.cpp's native build: int8 1.45x, float 1.27x; a "
        "CPU at this level without AVX512-VNNI takes the AVX2 int8 build (int8 at avx2 too)",
    ),
    "avx512_bf16": AutoActivations(
        "int8",
        "Intel Xeon with AMX-BF16 and AVX512-VNNI capped at avx512_bf16, 2026-11-28 "
        "(intel-amx/decode_vs_llamacpp_int8_capped.json); AMD Zen 5's float runs of "
        "2026-11-26 (amd-avx512bf16/) were 0.92-1.18x, its int8 not measured",
        "Llama-3.2-3B Q4_K_M decode vs llama.cpp's native build: int8 1.51x, float 1.13x",
    ),
    "amx": AutoActivations(
        "int8",
        "Intel Xeon with AMX-BF16 and AVX512-VNNI, 2026-11-28, "
        "benchmarks/decode_vs_llamacpp.py (intel-amx/decode_vs_llamacpp_int8.json)",
        "Q4_K_M decode vs llama.cpp's native build: 3B int8 1.58x (float 1.21x), 8B 1.44x "
        "(1.06x); the embedded model's steps within 4 % of float (decode_steps_numerics.json)",
    ),
}


def resolve_decode_activations(mode: str) -> str:
    """``"float"`` or ``"int8"`` for a ``decode_activations`` setting (``"auto"``: this CPU
    level's row of :data:`AUTO_BY_LEVEL`)."""
    if mode == "auto":
        return AUTO_BY_LEVEL[cpu.cpu_isa()].mode
    if mode not in ("float", "int8"):
        raise RagblendError(f"decode_activations must be auto, float or int8, got {mode!r}")
    return mode


class Int8Kernels(NamedTuple):
    """``matmul(x, blocks, qtype, cols, bias)``: float32 x ``[n, cols]`` (n <= 16) -> float32
    ``[n, rows]``; ``matmul_cat(x, [blocks...], [qtype...], cols, [bias...])``: several
    weights side by side; ``quantize(x, block)``: x's codes, scales and sums per 16. ``build``:
    the name of the build these are (one of :data:`BUILDS`)."""

    matmul: Callable[..., torch.Tensor]
    matmul_cat: Callable[..., torch.Tensor]
    quantize: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    build: str = "ragblend_q8"


_BUILT: Int8Kernels | str | None = None  # the kernels, or why not


def runs_here(build: Build) -> bool:
    """Whether this CPU (capped by ``RAGBLEND_CPU_ISA``) runs ``build``: its level and the
    flags it needs beyond it (:data:`EXTRA_FLAGS`)."""
    extra = EXTRA_FLAGS.get(build.name, frozenset())
    return cpu.isa_at_least(build.level) and extra <= cpu.cpu_flags()


def int8_kernels() -> Int8Kernels | None:
    """The checked kernels of the widest build this CPU runs (:data:`BUILDS`), built once per
    process; None (one warning per process says why) where the CPU is below AVX2 or the AVX2
    build or a check fails (a wider build's failure is one warning, then the next build)."""
    global _BUILT
    if _BUILT is None:
        _BUILT = _first_build()
    return _BUILT if isinstance(_BUILT, Int8Kernels) else None


def _first_build() -> Int8Kernels | str:
    if not cpu.isa_at_least(LEVEL):
        why = f"they need CPU level {LEVEL}; this CPU is at {cpu.cpu_isa()}"
        log.warning("8-bit decode activations are off, decoding in float: %s", why)
        return why
    try:
        built = widest_that_loads(
            BUILDS, lambda b: kernels_of(b.name), runs_here, "int8 kernels", log
        )
    except Exception as exc:  # compiler missing or failing, or a check: the message says
        log.warning("8-bit decode activations are off, decoding in float: %s", exc)
        return str(exc)
    assert built is not None, "the last build is the least level"
    return built


@contextmanager
def int8_kernels_in_use(kernels: Int8Kernels) -> Iterator[None]:
    """``kernels`` (one build's, :func:`kernels_of`) as :func:`int8_kernels` inside the block:
    for benchmarks that compare builds in one process."""
    global _BUILT
    before, _BUILT = _BUILT, kernels
    try:
        yield
    finally:
        _BUILT = before


def kernels_of(name: str) -> Int8Kernels:
    """The checked kernels of the build ``name`` (one of :data:`BUILDS`), built (or loaded)
    now: for tests and benchmarks that compare builds in one process. ValueError for an
    unknown build or one this CPU does not run; whatever the build or its check raises."""
    build = next((b for b in BUILDS if b.name == name), None)
    if build is None:
        raise ValueError(f"no int8 kernel build {name!r}: {[b.name for b in BUILDS]}")
    if not runs_here(build):
        raise ValueError(f"this CPU ({cpu.cpu_isa()}) does not run the {name} build")
    ops = load_ops(build.name, ["quant_int8.cpp"], build.flags)
    kernels = Int8Kernels(ops.matmul, ops.matmul_cat, ops.quantize, build.name)
    check(kernels)
    return kernels


def check(kernels: Int8Kernels) -> None:
    """RuntimeError unless, on random blocks of every type, the kernels quantize x as the
    reference does (bit for bit), their matmul equals :func:`~ragblend.kernels.cpu.int8_reference.
    matmul_reference` within :func:`~ragblend.kernels.cpu.int8_reference.term_bound`, each row of
    a batch is the same alone, and matmul_cat gives each weight's matmul side by side."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, 512, generator=gen) * torch.rand(5, 1, generator=gen) * 3
    x[1, :40] = 0.0  # a block of zeros: d = 0
    for block in (32, 256):
        want = ref.quantize_rows(x, block)
        q, d, sums = kernels.quantize(x, block)
        if not (torch.equal(q, want.q) and torch.equal(d, want.d)):
            raise RuntimeError(f"the kernels quantize x in blocks of {block} other than llama.cpp")
        if not torch.equal(sums.long(), want.sums16):
            raise RuntimeError("the kernels' sums of x's codes are wrong")
    for qtype, name in QUANT_TYPES.items():
        blocks = random_blocks(7, 512, qtype, gen)
        bias = torch.randn(7, generator=gen)
        got = kernels.matmul(x, blocks, qtype, 512, bias)
        expected = ref.matmul_reference(x, blocks, qtype, 512, bias)
        bound = ref.term_bound(x, blocks, qtype, 512, bias)
        if not bool(((got - expected).abs() <= bound).all()):
            raise RuntimeError(f"{name} int8 matmul does not match the integer reference")
        for i in range(x.shape[0]):
            if not torch.equal(kernels.matmul(x[i : i + 1], blocks, qtype, 512, bias)[0], got[i]):
                raise RuntimeError(f"{name} int8 matmul gives a row in a batch other than alone")
    qtypes = [6, 8, 12]
    parts = [random_blocks(rows, 512, q, gen) for rows, q in zip((40, 9, 33), qtypes)]
    biases = [torch.randn(40, generator=gen), None, None]
    cat = kernels.matmul_cat(x, parts, qtypes, 512, biases)
    alone = [kernels.matmul(x, b, q, 512, c) for b, q, c in zip(parts, qtypes, biases)]
    if not torch.equal(cat, torch.cat(alone, 1)):
        raise RuntimeError("int8 matmul_cat is not each weight's matmul side by side")


_step = threading.local()


@contextmanager
def step_activations(activations: str = "float") -> Iterator[None]:
    """Marks this thread as running a decode step with ``activations`` (``"float"`` or
    ``"int8"``, a resolved setting) while inside: the quantized linears take the int8 kernels
    only inside an int8 step, so a prefill of a few rows keeps the exact path."""
    before = getattr(_step, "int8", False)
    _step.int8 = activations == "int8"
    try:
        yield
    finally:
        _step.int8 = before


def in_int8_step() -> bool:
    """Whether this thread is inside :func:`step_activations` ``("int8")``."""
    return bool(getattr(_step, "int8", False))
