"""Token selectors: which cached rows to recompute at a check layer (HKVD tokens)."""

from __future__ import annotations

from typing import Protocol

import torch


class TokenSelector(Protocol):
    """Scores rows that have a cached KV; higher score → recomputed first."""

    name: str

    def scores(
        self,
        layer: int,
        fresh_k: torch.Tensor,
        fresh_v: torch.Tensor,
        cached_k: torch.Tensor,
        cached_v: torch.Tensor,
    ) -> torch.Tensor:
        """Tensors [1, kv_heads, m, head_dim] (K pre-RoPE) → scores [m]."""


class KVDeviationSelector:
    """Squared L2 distance between fresh and cached K and/or V, in fp32, over heads × dims."""

    name = "kv-deviation"

    def __init__(self, deviation: str = "kv") -> None:
        self.deviation = deviation

    def scores(self, layer, fresh_k, fresh_v, cached_k, cached_v) -> torch.Tensor:
        total = None
        if "k" in self.deviation:
            total = _squared_distance(fresh_k, cached_k)
        if "v" in self.deviation:
            dv = _squared_distance(fresh_v, cached_v)
            total = dv if total is None else total + dv
        return total


class RandomSelector:
    """Uniformly random rows: the control that shows deviation-based selection matters."""

    name = "random"

    def __init__(self, deviation: str = "kv", seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def scores(self, layer, fresh_k, fresh_v, cached_k, cached_v) -> torch.Tensor:
        return torch.rand(fresh_k.shape[2], generator=self.generator).to(fresh_k.device)


def _squared_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    diff = a.float() - b.float()
    # Normalise per layer so K and V deviations are on comparable scales when summed.
    d = diff.pow(2).sum(dim=(0, 1, 3))
    return d / d.mean().clamp_min(1e-12)


SELECTORS: dict[str, type] = {"kv-deviation": KVDeviationSelector, "random": RandomSelector}


def make_selector(name: str, deviation: str = "kv") -> TokenSelector:
    from ragblend.errors import RagblendError

    try:
        return SELECTORS[name](deviation=deviation)
    except KeyError:
        raise RagblendError(
            f"unknown selector {name!r}; available: {', '.join(SELECTORS)}"
        ) from None
