"""Linears that read the same input joined into one matmul (q/k/v, gate/up) for the fused path.

On a GPU a prefill layer's row counts are small enough that each matmul's launch and tail
count: q, k and v as one matmul and gate and up as another take two launches where HF's
modules take five. The joined weight is one tensor and the modules' own weights become views
of it (the same memory, the same values: HF's forward still runs on them); the join is checked
on each use and made again when the modules' weights were replaced or moved (``model.to``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class JoinedLinear(NamedTuple):
    """``modules``' weights [sum(out), in] as one tensor (and biases, if they all have one).

    Calling it gives each module's output as a view of one [..., sum(out)] product."""

    modules: tuple[nn.Linear, ...]
    weight: torch.Tensor
    bias: torch.Tensor | None
    sizes: tuple[int, ...]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)

    def is_current(self) -> bool:
        """Whether every module still reads its rows of the joined weight (and bias)."""
        offset = 0
        for module, size in zip(self.modules, self.sizes, strict=True):
            if module.weight.data_ptr() != self.weight[offset].data_ptr():
                return False
            bias = module.bias
            if self.bias is not None and (
                bias is None or bias.data_ptr() != self.bias[offset:].data_ptr()
            ):
                return False
            offset += size
        return True


def joinable(modules: Sequence[nn.Module]) -> bool:
    """Whether ``modules`` are plain ``nn.Linear`` of one input width, dtype and device, with
    biases on all or none (quantized or packed linears are not joined)."""
    if not modules or any(type(m) is not nn.Linear for m in modules):
        return False
    first = modules[0]
    assert isinstance(first, nn.Linear)
    return all(
        isinstance(m, nn.Linear)
        and m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and m.weight.device == first.weight.device
        and (m.bias is None) == (first.bias is None)
        for m in modules
    )


@torch.inference_mode(False)  # a normal tensor even when joined inside a prefill: the
@torch.no_grad()  # modules' weights stay usable by autograd (an inference tensor is not)
def join_linears(modules: Sequence[nn.Module]) -> JoinedLinear | None:
    """``modules`` joined (see the module docstring), or None where they are not
    :func:`joinable`. Their weights become views of the joined tensor; the old tensors are
    freed once nothing else holds them (peak memory: one layer's joined weights more)."""
    if not joinable(modules):
        return None
    linears = tuple(m for m in modules if isinstance(m, nn.Linear))
    sizes = tuple(m.out_features for m in linears)
    weight = torch.cat([m.weight for m in linears])
    bias = (
        torch.cat([m.bias for m in linears if m.bias is not None])
        if linears[0].bias is not None
        else None
    )
    offset = 0
    for m, size in zip(linears, sizes, strict=True):
        grad = m.weight.requires_grad
        m.weight = nn.Parameter(weight[offset : offset + size], requires_grad=grad)
        if bias is not None:
            m.bias = nn.Parameter(bias[offset : offset + size], requires_grad=grad)
        offset += size
    return JoinedLinear(linears, weight, bias, sizes)
