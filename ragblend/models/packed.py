"""One-row bf16 linears through oneDNN's prepacked weights: decoding on CPU.

A decode step multiplies one row by every weight matrix. In bf16 on CPU, ``F.linear`` reads
those weights at 7–25 GB/s on the benchmark machine; the same oneDNN primitive with the weight
reordered once for a batch of one (what inductor's weight prepacking does) reads them at
9–50 GB/s, and gave bit-identical outputs in every shape measured (SmolLM2's seven projections
and its 49k-row LM head). So the linears of a bf16 CPU model send one-row inputs there and
everything else to ``F.linear`` as before. Linears that read the same input are fused for one
row — an attention's q/k/v, an MLP's gate/up — into one GEMM over their stacked weights: each
output column is the same dot product, so the values stay identical, and a step makes three
calls fewer per layer (≈7 % faster decoding at 3.2k tokens). The reordered weights are a
second copy of the linear weights, made when an engine first decodes
(``BlendConfig(packed_decode=False)`` keeps memory at one copy).

oneDNN reorders bf16 weights only on CPUs with AVX512 (BW/VL/DQ) or AVX-NE-CONVERT
(:func:`ragblend.cpu.onednn_packs_bf16`); elsewhere, or if the reorder fails anyway, the
model keeps ``F.linear`` and one log line says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from ragblend import cpu

log = logging.getLogger(__name__)

_ATTR = "_ragblend_packed"
_TRIED = "_ragblend_pack_tried"  # on a model: packing was attempted (and logged) once
_QKV = "_ragblend_packed_qkv"  # on an attention module: one-row x → (q, k, v)
_QKV_NAMES = ("q_proj", "k_proj", "v_proj")
_GATE_UP_NAMES = ("gate_proj", "up_proj")

Fused = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


def available() -> bool:
    """Whether this torch build has oneDNN's linear prepacking (CPU builds with mkldnn)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def cpu_packs() -> bool:
    """Whether oneDNN can prepack bf16 weights here: a oneDNN build and a CPU level it packs
    at (see :func:`ragblend.cpu.onednn_packs_bf16`)."""
    return available() and cpu.onednn_packs_bf16()


def pack_one_row_linears(model: nn.Module) -> int:
    """Route one-row inputs of every bf16 CPU ``nn.Linear`` of ``model`` through a prepacked
    weight — q/k/v and gate/up fused, the others one by one; returns how many linears were
    newly packed (0 where it does not apply, and once ``model`` is packed: then this returns
    at once). Where oneDNN cannot pack (:func:`cpu_packs`, or a reorder that raises), nothing
    is packed and one log line per model says why.

    Fused linears get no prepacked copy of their own (that would be a third copy of their
    weights): their one-row path is :func:`qkv_projections` and the MLP's ``forward``, which
    the layer-wise decoder uses; HF's own forward (decoding over a sliding-window cache) runs
    q/k/v unpacked.
    """
    if getattr(model, _ATTR, False) or getattr(model, _TRIED, False):
        return 0
    if not any(_packable(m) for m in model.modules()):
        return 0
    setattr(model, _TRIED, True)
    if not cpu_packs():
        log.info(
            "decoding without prepacked bf16 weights: oneDNN packs them with AVX512 or "
            "AVX-NE-CONVERT, and this CPU is at level %s",
            cpu.cpu_isa(),
        )
        return 0
    try:
        return _pack(model)
    except RuntimeError as exc:  # oneDNN's own check of the CPU, should ours be wrong
        unpack_one_row_linears(model)
        setattr(model, _TRIED, True)
        log.warning("decoding without prepacked bf16 weights: oneDNN could not pack (%s)", exc)
        return 0


def _pack(model: nn.Module) -> int:
    fused: set[int] = set()
    for module in model.modules():
        qkv = _fused(module, _QKV_NAMES)
        if qkv is not None:
            setattr(module, _QKV, qkv)
            fused.update(id(getattr(module, name)) for name in _QKV_NAMES)
        gated = callable(getattr(module, "act_fn", None))
        gate_up = _fused(module, _GATE_UP_NAMES) if gated else None
        if gate_up is not None:
            module.forward = _one_row_mlp(module, gate_up)
            setattr(module, _ATTR, True)
            fused.update(id(getattr(module, name)) for name in _GATE_UP_NAMES)
    packed = len(fused)
    for module in model.modules():
        if not _packable(module) or id(module) in fused or getattr(module, _ATTR, False):
            continue
        module.forward = _one_row_forward(module)  # type: ignore[method-assign,assignment]
        setattr(module, _ATTR, True)
        packed += 1
    setattr(model, _ATTR, True)
    return packed


def unpack_one_row_linears(model: nn.Module) -> None:
    """Undo :func:`pack_one_row_linears` (the classes' own ``forward`` again)."""
    vars(model).pop(_TRIED, None)
    for module in model.modules():
        vars(module).pop(_QKV, None)
        if getattr(module, _ATTR, False):
            vars(module).pop("forward", None)
            delattr(module, _ATTR)


def qkv_projections(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)``: one fused GEMM for a packed
    model's one-row bf16 input, the three modules otherwise (the same values either way)."""
    fused: Fused | None = vars(attn).get(_QKV)
    if fused is not None and _one_row(x):
        return fused(x)
    mods: Any = attn
    return mods.q_proj(x), mods.k_proj(x), mods.v_proj(x)


def _packable(module: nn.Module) -> TypeGuard[nn.Linear]:
    return (
        isinstance(module, nn.Linear)
        and module.weight.dtype == torch.bfloat16
        and module.weight.device.type == "cpu"
    )


def _one_row(x: torch.Tensor) -> bool:
    return x.numel() == x.shape[-1] and x.dtype == torch.bfloat16 and not x.requires_grad


def _prepacked(
    weight: torch.Tensor, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``F.linear(x, weight, bias)`` for one-row ``x``, on ``weight`` reordered once by oneDNN
    for a batch of one."""
    with torch.no_grad():
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)

    def linear(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")

    return linear


def _one_row_forward(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    weight, bias = module.weight, module.bias
    packed = _prepacked(weight, bias)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return packed(x) if _one_row(x) else F.linear(x, weight, bias)

    return forward


def _fused(module: nn.Module, names: Sequence[str]) -> Fused | None:
    """One prepacked GEMM over the stacked weights of ``module``'s linears ``names`` (same
    input size, all with or all without bias), split back into their outputs; or None."""
    linears = [getattr(module, name, None) for name in names]
    if not all(lin is not None and _packable(lin) for lin in linears):
        return None
    layers: list[nn.Linear] = linears  # type: ignore[assignment]
    with_bias = [lin.bias is not None for lin in layers]
    if len({lin.in_features for lin in layers}) != 1 or len(set(with_bias)) != 1:
        return None
    with torch.no_grad():
        stacked = torch.cat([lin.weight.detach() for lin in layers])
        bias = torch.cat([lin.bias.detach() for lin in layers]) if with_bias[0] else None
    packed = _prepacked(stacked, bias)
    sizes = [lin.out_features for lin in layers]

    def forward(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return packed(x).split(sizes, dim=-1)

    return forward


def _one_row_mlp(mlp: nn.Module, gate_up: Fused) -> Callable[[torch.Tensor], torch.Tensor]:
    """HF's gated MLP, ``down(act(gate(x)) * up(x))``, with gate/up fused for one row."""
    mods: Any = mlp
    own = type(mlp).forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not _one_row(x):
            return own(mlp, x)
        gate, up = gate_up(x)
        return mods.down_proj(mods.act_fn(gate) * up)

    return forward
