"""Fused layer-step ops for the device path: one op (one kernel on a GPU) per step of a layer.

On a GPU a blend layer's time at small row counts is its launches: HF's modules take six
kernels for an RMSNorm, five for each RoPE and two index copies for the K/V scatter. This
module defines those steps as single PyTorch custom ops (``torch.ops.ragblend_layer.*``):

* each has a **torch reference** (:data:`REFERENCE`) that computes HF's values with HF's own
  arithmetic (the same ops in the same order), used on the CPU and wherever no faster kernel
  is in use. Exactness by construction: a prefill through the reference ops equals one
  through HF's modules bit for bit.
* on CUDA a **Triton kernel** of the same step (:mod:`ragblend.kernels.cuda.triton_layer`) runs
  instead once :func:`ragblend.kernels.cuda.loading.layer_kernels` has checked it against the
  reference on the device (falling back to the reference with one warning where it does not
  match).

Because every step is one registered op, the kernel counter of :mod:`ragblend.bench.op_counter`
sees one launch per step on a CPU, as a GPU running the Triton kernels does.

Shapes: ``x`` [..., D]; ``q`` [1, H, T, d]; ``k`` [1, Hkv, T, d]; ``cos``/``sin`` [1, T, d];
``rows`` [m] int64 (ascending positions); ``gate``/``up`` [..., I].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch.library import custom_op

from ragblend.errors import RagblendError


# ---------------------------------------------------------------------- references (HF's math)
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``LlamaRMSNorm.forward``: fp32 mean of squares, scaled, cast back, times weight."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def add_rms_norm_reference(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual sum ``hidden + delta`` and its RMSNorm (a decoder layer's seam)."""
    total = hidden + delta
    return total, rms_norm_reference(total, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_qk_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``apply_rotary_pos_emb`` (rotate_half layout): new rotated q and k, contiguous
    (as a kernel writes them: the attention then reads q without a copy)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_rot = (q * cos) + (_rotate_half(q) * sin)
    k_rot = (k * cos) + (_rotate_half(k) * sin)
    return q_rot.contiguous(), k_rot.contiguous()


def rope_inplace_reference(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE applied to ``k`` in place, with ``LayerwiseModel.rotate_``'s values."""
    half = k.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    first = k[..., :half].clone()
    k[..., :half].mul_(cos[..., :half]).addcmul_(k[..., half:], sin[..., :half], value=-1)
    k[..., half:].mul_(cos[..., half:]).addcmul_(first, sin[..., half:])


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: the product inside HF's ``LlamaMLP`` (SiLU families)."""
    return F.silu(gate) * up


def scatter_rows_reference(
    k_all: torch.Tensor, v_all: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Write fresh K/V [1, Hkv, m, d] into the prompt's K/V [1, Hkv, N, d] at ``rows``."""
    k_all.index_copy_(2, rows, k)
    v_all.index_copy_(2, rows, v)


class LayerImpl(NamedTuple):
    """One implementation of every step (the torch references, or Triton kernels)."""

    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    rope_qk: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        tuple[torch.Tensor, torch.Tensor],
    ]
    rope_inplace: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    scatter_rows: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
    ]


REFERENCE = LayerImpl(
    "torch",
    rms_norm_reference,
    add_rms_norm_reference,
    rope_qk_reference,
    rope_inplace_reference,
    silu_mul_reference,
    scatter_rows_reference,
)

# The implementation the registered ops run on CUDA tensors (the reference until a checked
# Triton build is put in place by ``loading.layer_kernels``); CPU tensors always run the
# reference.
_CUDA_IMPL: list[LayerImpl] = [REFERENCE]


def _impl(t: torch.Tensor) -> LayerImpl:
    return _CUDA_IMPL[0] if t.is_cuda else REFERENCE


# ---------------------------------------------------------------------- the registered ops
@custom_op("ragblend_layer::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of ``x`` [..., D] (see :func:`rms_norm_reference`)."""
    return _impl(x).rms_norm(x, weight, eps)


@custom_op("ragblend_layer::add_rms_norm", mutates_args=())
def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden + delta`` and its RMSNorm (see :func:`add_rms_norm_reference`)."""
    return _impl(hidden).add_rms_norm(hidden, delta, weight, eps)


@custom_op("ragblend_layer::rope_qk", mutates_args=())
def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [1, H, T, d] and k [1, Hkv, T, d] (see :func:`rope_qk_reference`)."""
    return _impl(q).rope_qk(q, k, cos, sin)


@custom_op("ragblend_layer::rope_inplace", mutates_args=("k",))
def rope_inplace(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE applied to keys [1, Hkv, T, d] in place (see :func:`rope_inplace_reference`)."""
    _impl(k).rope_inplace(k, cos, sin)


@custom_op("ragblend_layer::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of two [..., I] (see :func:`silu_mul_reference`)."""
    return _impl(gate).silu_mul(gate, up)


@custom_op("ragblend_layer::scatter_rows", mutates_args=("k_all", "v_all"))
def scatter_rows(
    k_all: torch.Tensor, v_all: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Fresh K/V written into the prompt's K/V at ``rows`` (see
    :func:`scatter_rows_reference`)."""
    _impl(k_all).scatter_rows(k_all, v_all, rows, k, v)


def _rope_(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rope_inplace(k, cos, sin)
    return k


class LayerKernels(NamedTuple):
    """The fused steps a layer of the fusor calls (``BlendConfig.layer_kernels="fused"``).

    ``impl``: the implementation CUDA tensors run (``"torch"`` or ``"triton"``); CPU tensors
    run the torch references. The callables are the registered ops."""

    impl: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ] = add_rms_norm
    rope_qk: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        tuple[torch.Tensor, torch.Tensor],
    ] = rope_qk
    rope_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = _rope_
    silu_mul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_mul
    scatter_rows: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
    ] = scatter_rows


# ---------------------------------------------------------------------- choosing the kernels
LayerKernelsChoice = Literal["auto", "hf", "fused"]
LAYER_KERNELS: tuple[str, ...] = get_args(LayerKernelsChoice)


def check_layer_kernels(choice: str) -> str:
    """``choice`` if it is a ``layer_kernels`` value, else a RagblendError naming them."""
    if choice not in LAYER_KERNELS:
        raise RagblendError(
            f"unknown layer_kernels {choice!r}; expected one of {', '.join(LAYER_KERNELS)}"
        )
    return choice
