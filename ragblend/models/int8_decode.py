"""8-bit activations for a decode step's quantized linears (``BlendConfig.decode_activations``).

llama.cpp multiplies a GGUF's quantized weights by activations quantized to 8 bits per block
and integer dot products; the same file in Ollama, LM Studio or llama.cpp decodes that way.
With ``decode_activations="int8"`` ragblend does the same for decode steps — the arithmetic of
:mod:`ragblend.models.int8_reference` (its oracle), run by ``csrc/quant_int8.cpp``'s AVX2
kernels (``vpmaddubsw`` / ``vpmaddwd``) — and keeps prefills on the exact path (dequantize +
``F.linear``). ``"float"`` is the exact path everywhere; ``"auto"`` picks per CPU level from
:data:`AUTO_BY_LEVEL`, measured.

Only decode steps use it: :func:`step_activations` marks the thread while one runs with the
decoder's setting (``ragblend.layer_decode.decode_batch`` and the HF-forward decoder enter it),
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
from ragblend.extensions import load_ops
from ragblend.models import int8_reference as ref
from ragblend.models.quant_kernels import AVX2_FLAGS, QUANT_TYPES, random_blocks

log = logging.getLogger(__name__)

LEVEL = "avx2"  # the least the kernels need


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
        "float", "no CPU of this class measured", "the exact AVX512 kernels decode at 0.92-1.16x"
    ),
    "avx512_bf16": AutoActivations(
        "float",
        "AMD EPYC Zen 5, 2026-11-26 (decode_vs_llamacpp*.json, amd-avx512bf16/)",
        "the exact kernels decode at 0.92-1.18x llama.cpp's rate",
    ),
    "amx": AutoActivations("float", "not measured", "as avx512_bf16"),
}


def resolve(mode: str) -> str:
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
    weights side by side; ``quantize(x, block)``: x's codes, scales and sums per 16."""

    matmul: Callable[..., torch.Tensor]
    matmul_cat: Callable[..., torch.Tensor]
    quantize: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


_BUILT: Int8Kernels | str | None = None  # the kernels, or why not


def int8_kernels() -> Int8Kernels | None:
    """The checked kernels, built once per process; None (one warning per process says why)
    where the CPU is below AVX2, the build fails or a check fails."""
    global _BUILT
    if _BUILT is None:
        try:
            if not cpu.isa_at_least(LEVEL):
                raise RuntimeError(f"they need CPU level {LEVEL}; this CPU is at {cpu.cpu_isa()}")
            ops = load_ops("ragblend_q8", ["quant_int8.cpp"], AVX2_FLAGS)
            kernels = Int8Kernels(ops.matmul, ops.matmul_cat, ops.quantize)
            check(kernels)
            _BUILT = kernels
        except Exception as exc:  # compiler missing or failing, or a check: the message says
            log.warning("8-bit decode activations are off, decoding in float: %s", exc)
            _BUILT = str(exc)
    return _BUILT if isinstance(_BUILT, Int8Kernels) else None


def check(kernels: Int8Kernels) -> None:
    """RuntimeError unless, on random blocks of every type, the kernels quantize x as the
    reference does (bit for bit), their matmul equals :func:`~ragblend.models.int8_reference.
    matmul_reference` within :func:`~ragblend.models.int8_reference.term_bound`, each row of
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
