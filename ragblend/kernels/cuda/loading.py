"""Choosing the fused layer steps' implementation for a device: Triton kernels on CUDA once
they match the torch references of :mod:`~ragblend.kernels.cuda.layer_ops` there, else the
references (``BlendConfig.layer_kernels``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import cast

import torch

from ragblend.kernels.cuda import layer_ops
from ragblend.kernels.cuda.layer_ops import REFERENCE, LayerImpl, LayerKernels, check_layer_kernels

log = logging.getLogger(__name__)

# Tolerance of a kernel against the reference, per dtype: fp32 to a few ulps (a Triton kernel
# sums a row in another order and may contract products into FMAs), bf16/fp16 to one ulp.
_TOLERANCE = {
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (1e-2, 1e-2),
    torch.float16: (2e-3, 2e-3),
}
_WARNED: set[str] = set()


def mismatch(impl: LayerImpl, device: torch.device, dtype: torch.dtype) -> str | None:
    """The first step where ``impl`` differs from the torch references on random ``dtype``
    inputs on ``device`` (a sentence), or None when every step matches within tolerance."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    atol, rtol = _TOLERANCE.get(dtype, _TOLERANCE[torch.bfloat16])
    x, delta, weight = rand(7, 1000) * 5, rand(7, 1000), rand(1000) * 0.3 + 1
    q = rand(1, 9, 8, 64).transpose(1, 2)  # [1, 8, 9, 64] as a transposed view, as projected
    k = rand(1, 9, 2, 64).transpose(1, 2)
    cos, sin = rand(1, 9, 64), rand(1, 9, 64)
    rows = torch.tensor([0, 3, 4, 8], device=device)
    k_all, v_all = rand(1, 2, 9, 64), rand(1, 2, 9, 64)
    k_new, v_new = rand(1, 4, 2, 64).transpose(1, 2), rand(1, 4, 2, 64).transpose(1, 2)

    def rope_in_place(i: LayerImpl) -> torch.Tensor:
        out = k.contiguous()
        i.rope_inplace(out, cos, sin)
        return out

    def scattered(i: LayerImpl) -> tuple[torch.Tensor, torch.Tensor]:
        ka, va = k_all.clone(), v_all.clone()
        i.scatter_rows(ka, va, rows, k_new, v_new)
        return ka, va

    steps: dict[str, Callable[[LayerImpl], object]] = {
        "rms_norm": lambda i: i.rms_norm(x, weight, 1e-6),
        "add_rms_norm": lambda i: i.add_rms_norm(x, delta, weight, 1e-6),
        "rope_qk": lambda i: i.rope_qk(q, k, cos, sin),
        "rope_inplace": rope_in_place,
        "silu_mul": lambda i: i.silu_mul(x, delta),
        "scatter_rows": scattered,
    }
    for name, step in steps.items():
        try:
            got, want = _tensors(step(impl)), _tensors(step(REFERENCE))
        except Exception as exc:  # a kernel that fails to compile or launch on this device
            return f"{impl.name} {name} fails on {device.type} {dtype}: {exc}"
        for g, w in zip(got, want, strict=True):
            if g.shape != w.shape or not torch.allclose(g.float(), w.float(), atol, rtol):
                return f"{impl.name} {name} differs from the torch reference ({dtype})"
    return None


def _tensors(out: object) -> list[torch.Tensor]:
    return list(out) if isinstance(out, tuple) else [cast(torch.Tensor, out)]


def layer_kernels(choice: str, device: torch.device, dtype: torch.dtype) -> LayerKernels | None:
    """The fused layer steps for a model on ``device`` in ``dtype``, or None for HF's modules.

    ``"auto"`` and ``"hf"``: None (HF's modules; ``auto`` stays there until a GPU run of
    ``benchmarks/gpu_check.sh`` has checked the Triton kernels). ``"fused"``: the registered
    ops; on CUDA they run ragblend's Triton kernels once those match the references on the
    device, else the references with one warning saying why."""
    if check_layer_kernels(choice) != "fused":
        return None
    if device.type != "cuda":
        return LayerKernels("torch")
    reason = _triton_reason(device, dtype)
    if reason is None:
        return LayerKernels("triton")
    if reason not in _WARNED:
        _WARNED.add(reason)
        log.warning("%s; the fused layer steps run their torch references", reason)
    layer_ops._CUDA_IMPL[0] = REFERENCE
    return LayerKernels("torch")


def _triton_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the Triton kernels cannot run for ``dtype`` on ``device`` (None: put in use)."""
    from ragblend.kernels.cuda import triton_layer

    if not triton_layer.available():
        return "triton is not installed"
    impl = triton_layer.triton_impl()
    reason = mismatch(impl, device, dtype)
    if reason is None:
        layer_ops._CUDA_IMPL[0] = impl
    return reason
