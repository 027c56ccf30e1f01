"""One-row bf16 linears through oneDNN's prepacked weights: decoding on CPU.

A decode step multiplies one row by every weight matrix. In bf16 on CPU, ``F.linear`` reads
those weights at 7–25 GB/s on the benchmark machine; the same oneDNN primitive with the weight
reordered once for a batch of one (what inductor's weight prepacking does) reads them at
9–50 GB/s, and gave bit-identical outputs in every shape measured (SmolLM2's seven projections
and its 49k-row LM head). So every ``nn.Linear`` of a bf16 CPU model sends one-row inputs
there and everything else to ``F.linear`` as before. The reordered weights are a second copy
of the linear weights, made when an engine first decodes (``BlendConfig(packed_decode=False)``
keeps memory at one copy).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_ATTR = "_ragblend_packed"


def available() -> bool:
    """Whether this torch build has oneDNN's linear prepacking (CPU builds with mkldnn)."""
    return bool(torch.backends.mkldnn.is_available()) and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def pack_one_row_linears(model: nn.Module) -> int:
    """Route one-row inputs of every bf16 CPU ``nn.Linear`` of ``model`` through a prepacked
    weight; returns how many linears were newly packed (0 where it does not apply, and once
    ``model`` is packed: then this returns at once)."""
    if not available() or getattr(model, _ATTR, False):
        return 0
    packed = 0
    for module in model.modules():
        if not isinstance(module, nn.Linear) or getattr(module, _ATTR, False):
            continue
        if module.weight.dtype != torch.bfloat16 or module.weight.device.type != "cpu":
            continue
        module.forward = _one_row_forward(module)  # type: ignore[method-assign,assignment]
        setattr(module, _ATTR, True)
        packed += 1
    setattr(model, _ATTR, True)
    return packed


def unpack_one_row_linears(model: nn.Module) -> None:
    """Undo :func:`pack_one_row_linears` (the class's own ``forward`` again)."""
    for module in model.modules():
        if getattr(module, _ATTR, False):
            vars(module).pop("forward", None)
            delattr(module, _ATTR)


def _one_row_forward(module: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    weight, bias = module.weight, module.bias
    with torch.no_grad():
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1] and x.dtype == torch.bfloat16 and not x.requires_grad:
            return torch.ops.mkldnn._linear_pointwise(x, reordered, bias, "none", [], "")
        return F.linear(x, weight, bias)

    return forward
