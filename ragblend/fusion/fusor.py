"""The fusor: layer-by-layer selective recompute over concatenated chunk caches (paper §4)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ragblend.errors import RagblendError
from ragblend.fusion.attention import RowAttentionPlan, attend_rows
from ragblend.fusion.rows import PromptRows, prompt_rows
from ragblend.fusion.selection import (
    cached_key_temper,
    choose_rows,
    last_observed_layer,
    observe,
)
from ragblend.fusion.selectors import CheckLayer, TokenSelector
from ragblend.fusion.trace import FusionTrace
from ragblend.kernels import LayerKernels, NativeKernels, RopeKernel
from ragblend.models.adapters import LayerwiseModel
from ragblend.store.base import KVEntry


@dataclass
class Segment:
    """A piece of the prompt as token ids, with its cache if it has one.

    ``exact`` marks a cache that equals full prefill (a prefix cache at position 0): its rows
    are never recomputed. Rows of segments without a cache are always recomputed.
    ``computed``: the cache was computed for this prompt, not served from the store.
    ``fits``: the cache was precomputed after the chunk that precedes it in this prompt (one
    of its precompute neighbours), so it is nearly what full prefill computes
    (``BlendConfig.selection.fitted_chunk_weight``).
    """

    kind: str
    ids: list[int]
    kv: KVEntry | None = None
    exact: bool = False
    computed: bool = False
    fits: bool = False

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
    trace: FusionTrace | None = None,
    native: NativeKernels | None = None,
    gpu_path: bool = False,
    kernels: LayerKernels | None = None,
) -> FusionResult:
    """Run the prompt through every layer, recomputing only the selected rows.

    ``layers`` yields each layer's cached pre-RoPE K and V [1, Hkv, N, d] for the whole prompt
    (LayerLoader). ``schedule`` is [(check layer, fraction of cached rows kept)] (gradual
    filtering) and needs a ``selector``; ``None`` recomputes every non-exact row on every layer
    (ratio 1.0), ``[]`` recomputes only rows without a cache (full KV reuse).
    ``native``: ragblend's CPU kernels for selected-row attention, RoPE and RMSNorm
    (:mod:`ragblend.kernels.cpu.native`), or ``None`` for SDPA and HF's modules. ``gpu_path``: the
    kernels a GPU runs (launches cost more than bytes there): selected rows attend in one SDPA
    call per layer with a mask built on the device, not in position-ordered blocks that read
    the rows' positions on the host, and the cached-key temperature scales one copy of the
    keys (:class:`CachedKeyTemperature`'s ``one_pass``). Same logic, same values.

    No step of the layer loop reads the device back: every selection's size follows from the
    row counts the host knows (forced rows are always kept, a check layer keeps its budget).
    """
    if schedule and selector is None:
        raise RagblendError("a schedule with check layers needs a token selector")
    device = model.device
    rows = prompt_rows(segments, device)
    checks = dict(schedule or [])
    active = rows.forced_rows if schedule == [] else rows.candidates
    # the active rows' positions on the host, until a selection makes them device data
    active_list: list[int] | None = rows.forced_list if schedule == [] else rows.candidate_list
    forced = len(rows.forced_list)  # forced rows are active on every layer

    hidden = model.embed(rows.ids[active])
    ropes = RopeTables(model, torch.arange(rows.n, device=device), hidden[:, :0])
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    rows_per_layer: list[int] = []
    groups = model.num_heads // model.num_kv_heads
    plans: dict[int | None, RowAttentionPlan] = {}
    watched = last_observed_layer(selector, checks)  # multi-layer selectors see layers <= it
    memory: dict = {}  # their scratch space for this prefill
    # blend only, not reuse
    temper = cached_key_temper(selector, rows, one_pass=gpu_path) if schedule else None
    row_kernel = native.attend_rows if native is not None else None
    # RoPE of the projected rows and of the cached keys: HF's unless native
    fresh_rope = model.native_rope(native, ropes.full(0)[0])
    rotate_: RopeKernel = fresh_rope or model.rotate_
    if kernels is not None and model.rope_rotates_half:
        rotate_ = kernels.rope_
    norm = model.native_norm(native)
    for layer, k_cached, v_cached in layers:
        cos_all, sin_all = ropes.full(layer)
        # project
        cos, sin = ropes.rows(layer, active)
        proj = model.project(layer, hidden, cos, sin, fresh_rope, norm, kernels)
        if trace is not None:
            trace.projected(layer, proj, active)
        # select (scores compare fresh rows with the still-unmodified pre-RoPE cache)
        keep = None
        computed = active
        if layer in checks or layer <= watched:
            k_full = model.rotate(k_cached, cos_all, sin_all)
            check = CheckLayer.build(
                layer,
                proj,
                k_cached,
                v_cached,
                k_full,
                active,
                rows,
                model.scaling(layer),
                memory,
                free=int(active.numel()) - forced,
            )
            observe(selector, check)
        else:  # the loader's tensors are this request's own: rotate them in place
            k_full = rotate_(k_cached, cos_all, sin_all)
        if layer in checks:
            keep, scores = select_rows(
                selector, check, rows.forced[active], checks[layer], rows.num_approx
            )
        # write fresh K/V: every active row gets them on this layer
        if kernels is None:
            k_full.index_copy_(2, active, proj.k)
            v_cached.index_copy_(2, active, proj.v)
        else:
            kernels.scatter_rows(k_full, v_cached, active, proj.k, proj.v)
        rows_per_layer.append(int(active.numel()))
        q = proj.q
        if keep is not None and keep.numel() < active.numel():
            # only the kept rows go on through attention, o_proj and MLP
            q, hidden, active = q[:, :, keep], hidden[:, keep], active[keep]
            active_list = None
            plans.clear()
        if keep is not None and trace is not None:
            trace.selected(layer, scores, active)
        # attend
        window = model.sliding_window(layer)
        plan = plans.get(window)
        if plan is None:
            plan = plans[window] = RowAttentionPlan(
                active,
                groups,
                q.dtype,
                window,
                rows.n,
                row_kernel,
                exact_causal=schedule is None,
                host_positions=active_list,
                device_masks=gpu_path,
            )
        if temper is None:
            attn = attend_rows(q, k_full, v_cached, plan, model.scaling(layer))
        else:
            # computed rows: every uncached row (forced), the rest approximate ones
            stale = rows.num_approx - (int(computed.numel()) - rows.num_uncached)
            attn = temper.attend(q, k_full, v_cached, plan, model.scaling(layer), computed, stale)
        # finish
        hidden = model.finish(layer, hidden, attn, norm, kernels)
        keys.append(k_full)
        values.append(v_cached)

    return FusionResult(
        logits=model.logits(hidden[:, -1:])[-1],
        keys=keys,
        values=values,
        rows_per_layer=rows_per_layer,
        candidates=int(rows.candidates.numel()),
        selected=active,
    )


class RopeTables:
    """cos/sin of every prompt position for each rotary embedding the layers use (one for
    most families; Gemma 3 has one per layer type), and their rows for the active set."""

    def __init__(self, model: LayerwiseModel, positions: torch.Tensor, like: torch.Tensor):
        self.model, self.positions, self.like = model, positions, like
        self._full: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rows: dict[str, tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]] = {}

    def full(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, N, d] of ``layer``'s rotary embedding at positions 0…N-1."""
        group = self.model.rope_group(layer)
        table = self._full.get(group)
        if table is None:
            table = self._full[group] = self.model.rope(self.positions, self.like, layer)
        return table

    def rows(self, layer: int, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, m, d] of the ``active`` rows (gathered again only when rows drop)."""
        group = self.model.rope_group(layer)
        gathered = self._rows.get(group)
        if gathered is None or gathered[0] is not active:
            cos, sin = self.full(layer)
            gathered = self._rows[group] = (active, (cos[:, active], sin[:, active]))
        return gathered[1]


def select_rows(
    selector: TokenSelector | None,
    check: CheckLayer,
    is_forced: torch.Tensor,
    fraction: float,
    num_approx: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local indices (into ``check.active``, ascending) kept after a check layer, and scores.

    Forced rows are always kept; of the free rows (``check.candidates``), the ``fraction`` of
    ``num_approx`` with the highest scores. Without a selector, a budget below the free rows
    is an error (never a silent empty selection).
    """
    budget = int(round(fraction * num_approx))
    free = check.candidates
    scores = torch.zeros(check.active.numel(), device=check.active.device)
    if budget >= free.numel():
        chosen = free
    elif selector is None:
        raise RagblendError("selecting a share of the cached rows needs a token selector")
    else:
        s = selector.scores(check)
        scores[free] = s.float()
        chosen = free[choose_rows(selector, check, s, budget)]
    # the kept rows as a mask, read back in order: their count is known without the device
    kept = is_forced.clone()
    kept[chosen] = True
    forced = check.active.numel() - free.numel()
    return kept.nonzero_static(size=forced + chosen.numel()).squeeze(1), scores


__all__ = ["FusionResult", "PromptRows", "Segment", "fuse", "select_rows"]
