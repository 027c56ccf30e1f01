"""Optional observers of the fusion loop (precompute's pre-RoPE capture, benchmarks, tests).

The fusor calls ``projected`` after each layer's projection and ``selected`` after each check
layer's selection; an observer records what it needs and the loop stays free of debug flags.
"""

from __future__ import annotations

import torch

from ragblend.models.adapters import LayerProjections


class FusionTrace:
    """Base observer: every hook does nothing."""

    def projected(self, layer: int, proj: LayerProjections, active: torch.Tensor) -> None:
        """``proj`` holds the fresh q/k/v of rows ``active`` (original positions) on ``layer``."""

    def selected(self, layer: int, scores: torch.Tensor, active: torch.Tensor) -> None:
        """At a check layer: selector ``scores`` over the previously active rows (0 where not
        scored) and the rows kept, ``active`` (original positions, ascending)."""


class PreRopeCapture(FusionTrace):
    """Keeps each layer's fresh pre-RoPE K of the computed rows ([1, kv_heads, m, d])."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def projected(self, layer: int, proj: LayerProjections, active: torch.Tensor) -> None:
        self.keys.append(proj.k_pre)


class SelectionTrace(FusionTrace):
    """Keeps the rows kept and the selector scores at each check layer."""

    def __init__(self) -> None:
        self.selections: dict[int, torch.Tensor] = {}
        self.scores: dict[int, torch.Tensor] = {}

    def selected(self, layer: int, scores: torch.Tensor, active: torch.Tensor) -> None:
        self.selections[layer] = active
        self.scores[layer] = scores
