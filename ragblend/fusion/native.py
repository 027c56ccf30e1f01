"""ragblend's CPU kernels for the fusor, compiled on first use (once per machine).

SDPA has no CPU kernel that lets each query row attend exactly its own causal prefix: blend's
selected rows sit anywhere in the prompt, so :func:`attend_rows` otherwise runs them through
SDPA in position-ordered blocks with additive masks, each block reading keys up to its last
row. ``csrc/rows_attention.cpp`` does the whole layer in one call: AMX tile matmuls (ATen's
brgemm micro-kernel) over row tiles in position order, each row's online softmax stopping at
its own position, the query heads of one KV head stacked into one tile. Beside it,
``csrc/rope.cpp`` rotates keys and queries in place in one pass (torch takes five) and
``csrc/rms_norm.cpp`` is HF's Llama RMSNorm in one pass (torch takes six); both give HF's
values bit for bit. bf16 on CPUs with AMX-BF16 only; elsewhere (fp32, CUDA, a sliding window)
the SDPA blocks and HF's modules run.

``row_attention="auto"`` (the default) uses the kernels where they apply and warns once when a
CPU that could run them cannot build them (no C++ compiler); ``"native"`` raises instead;
``"sdpa"`` never uses them.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple, get_args

import torch

from ragblend.errors import RagblendError
from ragblend import cpu

log = logging.getLogger(__name__)

RowAttention = Literal["auto", "native", "sdpa"]
ROW_ATTENTION: tuple[str, ...] = get_args(RowAttention)
SOURCES = [
    Path(__file__).with_name("csrc") / name
    for name in ("rows_attention.cpp", "rope.cpp", "rms_norm.cpp")
]
# The kernels' tile instructions and the vector code they are compiled with.
REQUIRED_LEVEL = "amx"
COMPILE_FLAGS = [
    "-O3",
    "-DCPU_CAPABILITY_AVX512",
    "-DCPU_CAPABILITY=AVX512",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512bf16",
    "-mfma",
    # at::parallel_for's OpenMP pragmas; the runtime is torch's own libgomp, already loaded
    "-fopenmp",
]

# q [1, H, m, d], k [1, Hkv, N, d], v [1, Hkv, N, d], positions [m] int64, scale -> [1, m, H*d]
RowKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# k [1, Hkv, N, d] rotated in place (and returned), cos, sin [1, N, d]
RopeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# x [..., D] contiguous, weight [D], eps -> a new tensor like x
NormKernel = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


class NativeKernels(NamedTuple):
    """The compiled kernels: selected-row attention, in-place RoPE and Llama's RMSNorm
    (``None`` where it does not match this torch's bit for bit, see ``_rms_norm_if_exact``)."""

    attend_rows: RowKernel
    rope_: RopeKernel
    rms_norm: NormKernel | None = None


def check_row_attention(choice: str) -> str:
    """``choice`` if it is a ``row_attention`` value, else a RagblendError naming them."""
    if choice not in ROW_ATTENTION:
        raise RagblendError(
            f"unknown row_attention {choice!r}; expected one of {', '.join(ROW_ATTENTION)}"
        )
    return choice


def cpu_runs_kernel() -> bool:
    """True when the CPU level (:func:`ragblend.cpu.cpu_isa`) is ``amx``: AMX-BF16 tiles and
    the AVX512 code the kernels are compiled with."""
    return cpu.isa_at_least(REQUIRED_LEVEL)


def build_kernels() -> NativeKernels:
    """Compile (or load the cached build of) the kernels; RagblendError says why they cannot."""
    if not cpu_runs_kernel():
        raise RagblendError(
            f"ragblend's native kernels need CPU level {REQUIRED_LEVEL} (amx_bf16, amx_tile, "
            f"avx512_bf16, avx512f/bw/vl/dq); this CPU is at level {cpu.cpu_isa()}"
        )
    return _compiled()


@functools.cache
def _compiled() -> NativeKernels:
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:
        # torch runs `ninja` from PATH; the ninja wheel (a dependency) installs it beside this
        # interpreter, which is not on PATH when the venv is used without activating it
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])

    log.info("loading ragblend's native kernels (compiled once per machine)")
    try:
        load(
            name="ragblend_native",
            sources=[str(path) for path in SOURCES],
            extra_cflags=COMPILE_FLAGS,
            is_python_module=False,
        )
    except Exception as exc:  # compiler missing or failing: the message says which
        raise RagblendError(f"could not build ragblend's native kernels: {exc}") from exc
    ops = torch.ops.ragblend_native
    if not ops.supported():
        raise RagblendError("this CPU's oneDNN has no bf16 brgemm kernel (AMX) for row attention")
    return NativeKernels(ops.attend_rows, ops.rope_, _rms_norm_if_exact(ops.rms_norm))


def _rms_norm_if_exact(kernel: NormKernel) -> NormKernel | None:
    """``kernel`` if it equals HF's ``LlamaRMSNorm`` bit for bit on random rows of a few
    widths, else None with a warning. The kernel sums the squares in the order of torch's CPU
    sum kernel, which a torch other than the one ragblend pins could change."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    for width in (576, 1000, 4096):
        norm = LlamaRMSNorm(width, eps=1e-6).bfloat16()
        with torch.no_grad():
            norm.weight.copy_(torch.randn(width, generator=gen) * 0.3 + 1)
            x = (torch.randn(33, width, generator=gen) * 20).bfloat16()
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
    (RagblendError when they cannot run) or ``"sdpa"``."""
    if check_row_attention(choice) == "sdpa":
        return None
    fits = dtype == torch.bfloat16 and device.type == "cpu" and head_dim % 32 == 0
    if not fits:
        if choice == "native":
            raise RagblendError(
                "row_attention='native' runs bf16 models on CPU with a head dim that is a "
                f"multiple of 32; this model is {dtype} on {device.type}, head dim {head_dim}"
            )
        return None
    if choice == "auto" and not cpu_runs_kernel():
        return None
    try:
        return build_kernels()
    except RagblendError as exc:
        if choice == "native":
            raise
        log.warning("%s; selected rows attend through SDPA blocks instead", exc)
        return None
