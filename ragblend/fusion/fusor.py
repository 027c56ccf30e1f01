"""The fusor: layer-by-layer selective recompute over concatenated chunk caches (paper §4)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ragblend.fusion.attention import RowAttentionPlan, attend_rows
from ragblend.fusion.selectors import CheckLayer, TokenSelector
from ragblend.models.adapters import LayerwiseModel
from ragblend.store.base import ChunkKV


@dataclass
class Segment:
    """A piece of the prompt as token ids, with its cache if it has one.

    ``exact`` marks a cache that equals full prefill (a prefix cache at position 0): its rows
    are never recomputed. Rows of segments without a cache are always recomputed.
    """

    kind: str
    ids: list[int]
    kv: ChunkKV | None = None
    exact: bool = False

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class FusionResult:
    logits: torch.Tensor  # [vocab] fp32, for the last prompt token
    keys: list[torch.Tensor]  # per layer, post-RoPE [1, Hkv, N, d]
    values: list[torch.Tensor]
    rows_per_layer: list[int]
    candidates: int  # rows that could be recomputed (not in an exact cache)
    selected: torch.Tensor  # rows active on the last layer
    pre_rope_keys: list[torch.Tensor] | None = None  # active rows, when captured
    deviations: dict[int, torch.Tensor] = field(default_factory=dict)
    selections: dict[int, torch.Tensor] = field(default_factory=dict)  # after each check layer

    @property
    def recomputed_fraction(self) -> float:
        if not self.candidates:
            return 0.0
        return sum(self.rows_per_layer) / (len(self.rows_per_layer) * self.candidates)


@torch.inference_mode()
def fuse(
    model: LayerwiseModel,
    segments: Sequence[Segment],
    layers: Iterable[tuple[int, torch.Tensor, torch.Tensor]],
    schedule: Sequence[tuple[int, float]] | None,
    selector: TokenSelector | None = None,
    capture_pre_rope: bool = False,
    keep_deviations: bool = False,
) -> FusionResult:
    """Run the prompt through every layer, recomputing only the selected rows.

    ``layers`` yields each layer's cached pre-RoPE K and V for the whole prompt (LayerLoader).
    ``schedule`` is [(check layer, fraction of cached rows kept)] (gradual filtering); ``None``
    recomputes every non-exact row on every layer (ratio 1.0), ``[]`` recomputes only rows
    without a cache (full KV reuse).
    """
    device = model.device
    ids = torch.tensor([t for s in segments for t in s.ids], device=device, dtype=torch.long)
    n = ids.numel()
    cached = torch.zeros(n, dtype=torch.bool, device=device)
    exact = torch.zeros(n, dtype=torch.bool, device=device)
    start = 0
    for seg in segments:
        cached[start : start + len(seg)] = seg.kv is not None
        exact[start : start + len(seg)] = seg.kv is not None and seg.exact
        start += len(seg)
    forced = ~cached
    forced[n - 1] = True  # the last prompt token yields the first generated token
    candidates = (~exact).nonzero().squeeze(1)
    # The question (an uncached last segment) is what selectors may ask about attention.
    tail_start = n - (len(segments[-1]) if segments[-1].kv is None else 1)
    num_approx = int((cached & ~exact).sum())

    if schedule is None:
        active = candidates
        checks: dict[int, float] = {}
    elif len(schedule) == 0:
        active = forced.nonzero().squeeze(1)
        checks = {}
    else:
        active = candidates
        checks = dict(schedule)

    positions = torch.arange(n, device=device)
    hidden = model.embed(ids[active])
    cos_all, sin_all = model.rope(positions, hidden)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    pre_rope: list[torch.Tensor] = []
    rows_per_layer: list[int] = []
    deviations: dict[int, torch.Tensor] = {}
    selections: dict[int, torch.Tensor] = {}

    groups = model.num_heads // model.num_kv_heads
    plans: dict[int | None, RowAttentionPlan] = {}
    for layer, k_cached, v_cached in layers:
        proj = model.project(layer, hidden, cos_all[:, active], sin_all[:, active])
        if capture_pre_rope:
            pre_rope.append(proj.k_pre)
        k_full = model.rotate(k_cached, cos_all, sin_all)
        keep = None
        if layer in checks:  # scores compare fresh rows with the still-unmodified cache
            check = CheckLayer(layer, proj, k_cached, v_cached, k_full, active, tail_start,
                               model.scaling(layer))
            keep, dev = _select(selector, check, forced, checks[layer], num_approx)
            if keep_deviations:
                deviations[layer] = dev
        k_full[:, :, active] = proj.k
        v_cached[:, :, active] = proj.v
        rows_per_layer.append(int(active.numel()))
        q = proj.q
        if keep is not None:
            # Every row got fresh K/V on this layer; only the kept rows go on, so the rest of
            # the layer (attention, o_proj, MLP) runs on them alone.
            q, hidden, active = q[:, :, keep], hidden[:, keep], active[keep]
            selections[layer] = active
            plans.clear()
        window = model.sliding_window(layer)
        plan = plans.get(window)
        if plan is None:
            plan = plans[window] = RowAttentionPlan(active, groups, q.dtype, window)
        attn = attend_rows(q, k_full, v_cached, plan, model.scaling(layer))
        hidden = model.finish(layer, hidden, attn)
        keys.append(k_full)
        values.append(v_cached)

    logits = model.logits(hidden[:, -1:])[-1]
    return FusionResult(
        logits=logits,
        keys=keys,
        values=values,
        rows_per_layer=rows_per_layer,
        candidates=int(candidates.numel()),
        selected=active,
        pre_rope_keys=pre_rope if capture_pre_rope else None,
        deviations=deviations,
        selections=selections,
    )


def _select(
    selector: TokenSelector | None,
    check: CheckLayer,
    forced: torch.Tensor,
    fraction: float,
    num_approx: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local indices (into ``active``, ascending) kept after this check layer, and the scores."""
    active = check.active
    is_forced = forced[active]
    budget = int(round(fraction * num_approx))
    free = (~is_forced).nonzero().squeeze(1)
    scores = torch.zeros(active.numel(), device=active.device)
    if budget >= free.numel() or selector is None:
        chosen = free if budget >= free.numel() else free[:0]
    else:
        check.candidates = free
        s = selector.scores(check)
        scores[free] = s.float()
        chosen = free[torch.topk(s, budget).indices] if budget > 0 else free[:0]
    keep = torch.cat([is_forced.nonzero().squeeze(1), chosen]).sort().values
    return keep, scores
