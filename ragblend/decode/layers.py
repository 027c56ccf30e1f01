"""The layers of one decode step, shared by the per-request decoders and the decode pool.

Per layer: the norm, projections and RoPE of the step's rows (``LayerwiseModel.project``),
the attention the caller gives (its K/V cache layout is the caller's), then o_proj and the
MLP (``LayerwiseModel.finish``); fp32 logits at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ragblend.models.adapters import LayerProjections, LayerwiseModel

if TYPE_CHECKING:
    from ragblend.kernels import LayerKernels, NativeKernels

# (layer, its projections [1, heads, B, d], its sliding window or None) -> [1, B, H*d]
Attend = Callable[[int, LayerProjections, int | None], torch.Tensor]


def step_layers(
    m: LayerwiseModel,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    attend: Attend,
    kernels: NativeKernels | None = None,
    fused: LayerKernels | None = None,
) -> torch.Tensor:
    """Every layer of a decode step of the rows ``hidden`` [1, B, D] at ``positions`` [B]
    → fp32 logits [B, vocab]. ``kernels``/``fused``: the native CPU or fused layer steps."""
    norm = m.native_norm(kernels)
    ropes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # one table per RoPE group
    for i in range(m.num_layers):
        group = m.rope_group(i)
        if group not in ropes:
            ropes[group] = m.rope(positions, hidden, i)
        cos, sin = ropes[group]
        proj = m.project(i, hidden, cos, sin, m.native_rope(kernels, cos), norm, fused)
        out = attend(i, proj, m.sliding_window(i))
        hidden = m.finish(i, hidden, out, norm, fused)
    return m.logits(hidden)
