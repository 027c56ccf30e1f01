"""One prompt's prefill, planned once: what is looked up, what is recomputed, and why.

:func:`plan_prefill` turns (prompt, mode, ratio, the store's state) into one frozen
:class:`PrefillPlan`: the loading controller's decision (``ratio="auto"``), the prompt as fusor
segments (the head's exact cache, each chunk's stored KV or none), which chunks missed, the
fusor's schedule, and whether a full prefill runs instead (its ``fallback_reason``). The engine
runs the plan — :func:`fused_prefill` over its segments, or :func:`full_prefill` — and
:meth:`PrefillPlan.record` writes what it decided into the request's stats. A stored entry that
fails verification while the fusor reads it is dropped; :meth:`PrefillPlan.looked_up_again`
then makes the one new plan that runs without it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from ragblend.decode import BlendStats, Prefill
from ragblend.fallback import CACHE_MISS, CONTROLLER_FULL, NO_KNOWN_CHUNK, fall_back
from ragblend.fusion.fusor import Segment, fuse
from ragblend.models.hf_cache import dynamic_cache_of
from ragblend.store.layered import served_from

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ragblend.chunk_cache import ChunkCache
    from ragblend.config import BlendConfig
    from ragblend.controller import Decision
    from ragblend.fusion.selectors import TokenSelector
    from ragblend.kernels import LayerKernels, NativeKernels
    from ragblend.models.adapters import LayerwiseModel
    from ragblend.prompt import TokenizedPrompt

log = logging.getLogger(__name__)

FUSED_MODES = ("prefix", "reuse", "blend")


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """How one prompt is prefilled (made by :func:`plan_prefill`).

    ``mode`` is the mode that runs (``"full"`` when the request falls back, with
    ``fallback_reason``, a code of :mod:`ragblend.fallback`, and ``fallback_message``);
    ``requested`` the one asked for. A fused plan carries the fusor's ``segments`` and
    ``schedule`` (``None``: every cached row recomputed, ratio 1; ``()``: only rows without a
    cache, reuse), ``ratio`` (blend's), and ``load_ms``, the lookup's time. ``missing``: the
    indices of the chunks that missed the store (``None`` where chunks were not looked up:
    full and prefix modes, a controller fallback). ``decision``: the loading controller's.
    ``chunk_tiers``: how many of the chunk hits each tier served (``(("ram", 4), ("redis",
    2))``; a layered store names the tier an entry was read from).
    """

    prompt: TokenizedPrompt
    requested: str
    mode: str
    segments: tuple[Segment, ...] = ()
    schedule: tuple[tuple[int, float], ...] | None = None
    ratio: float | None = None
    missing: tuple[int, ...] | None = None
    decision: Decision | None = None
    fallback_reason: str | None = None
    fallback_message: str | None = None
    load_ms: float = 0.0
    chunk_tiers: tuple[tuple[str, int], ...] = ()

    @property
    def fused(self) -> bool:
        """Whether the fusor runs (else a plain full prefill)."""
        return self.mode in FUSED_MODES

    @property
    def chunk_hits(self) -> int:
        """Chunks found in the store (0 where chunks were not looked up)."""
        return 0 if self.missing is None else len(self.prompt.chunks) - len(self.missing)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens served from a cache (a head computed for this prompt is not)."""
        return sum(len(s) for s in self.segments if s.kv is not None and not s.computed)

    @property
    def fusor_schedule(self) -> list[tuple[int, float]] | None:
        """``schedule`` as :func:`ragblend.fusion.fusor.fuse` takes it."""
        return None if self.schedule is None else list(self.schedule)

    def missed_texts(self) -> list[str]:
        """The texts of the chunks that missed (where the prompt knows its chunks' texts)."""
        if not self.missing or not self.prompt.chunk_texts:
            return []
        return [self.prompt.chunk_texts[i] for i in self.missing]

    def record(self, stats: BlendStats) -> None:
        """Write what this plan decided into ``stats`` (a fallback: ``stats.mode == "full"``
        and its reason; otherwise the ratio, the lookup's time and the cached tokens)."""
        if self.decision is not None:
            stats.extra["controller"] = dataclasses.asdict(self.decision)
        if self.missing is not None:
            stats.chunk_misses = len(self.missing)
            stats.chunk_hits = self.chunk_hits
            stats.extra["chunk_tiers"] = dict(self.chunk_tiers)  # the tier that served each hit
        if self.fallback_reason is not None:
            log.info("full prefill instead of %s: %s", stats.mode, self.fallback_message)
            fall_back(stats, self.fallback_reason, self.fallback_message)
            return
        if not self.fused:
            return
        if self.ratio is not None:
            stats.ratio = self.ratio
        stats.load_ms = self.load_ms
        stats.cached_tokens = self.cached_tokens

    def looked_up_again(self, chunks: ChunkCache) -> PrefillPlan:
        """This plan's prompt, mode, ratio and schedule looked up in ``chunks``' store again
        (after a stored entry was dropped); the controller's decision is kept, not made again."""
        return _looked_up(
            chunks, self.prompt, self.requested, self.ratio, self.schedule, self.decision
        )


def plan_prefill(
    chunks: ChunkCache,
    prompt: TokenizedPrompt,
    mode: str,
    ratio: float | str | None,
    config: BlendConfig,
    decide: Callable[[int], Decision],
) -> PrefillPlan:
    """The plan for ``prompt`` in ``mode`` (checked) at ``ratio`` (None: ``config.ratio``;
    ``"auto"``: ``decide(prompt tokens)``, the loading controller, asked only then), from what
    ``chunks``' store holds now. Looking up computes and stores a head the store lacks."""
    decision = None
    if mode == "blend" and (ratio == "auto" or (ratio is None and config.ratio == "auto")):
        decision = decide(len(prompt))
        ratio = decision.ratio
        if decision.fallback_full:
            why = (
                f"loading the chunk KV from the {decision.tier} tier would take longer than a "
                "full prefill (loading controller)"
                if decision.reason == "loading"
                else f"blend at ratio {max(decision.r_star, decision.r_load):.2f} would not be "
                "faster than a full prefill on this device (loading controller's profile)"
            )
            return PrefillPlan(
                prompt,
                mode,
                "full",
                decision=decision,
                fallback_reason=CONTROLLER_FULL,
                fallback_message=why,
            )
    blend_ratio: float | None = None
    schedule: tuple[tuple[int, float], ...] | None = None  # prefix: the rest all computed
    if mode == "reuse":
        schedule = ()
    elif mode == "blend":
        blend_ratio = float(config.ratio if ratio is None else ratio)
        schedule = None if blend_ratio >= 1.0 else tuple(config.schedule(blend_ratio))
    return _looked_up(chunks, prompt, mode, blend_ratio, schedule, decision)


def _looked_up(
    chunks: ChunkCache,
    prompt: TokenizedPrompt,
    mode: str,
    ratio: float | None,
    schedule: tuple[tuple[int, float], ...] | None,
    decision: Decision | None,
) -> PrefillPlan:
    """The plan once the store is read: segments, misses, a fallback when nothing is cached."""
    if mode == "full":
        return PrefillPlan(prompt, mode, mode, decision=decision)
    t_load = time.perf_counter()
    if mode == "prefix":  # exact prefix cache; everything after it is prefilled
        segments = chunks.prefix_segments(prompt)
        return PrefillPlan(prompt, mode, mode, tuple(segments), load_ms=_ms_since(t_load))
    found, missing = chunks.lookup(prompt)
    held = [s.kv for s in found if s.kind == "chunk" and s.kv is not None]
    tiers = tuple(collections.Counter(served_from(chunks.store, kv) for kv in held).items())
    if len(missing) == len(prompt.chunks):
        what = "every chunk missed the cache" if prompt.chunks else "no chunks given"
        return PrefillPlan(
            prompt,
            mode,
            "full",
            missing=tuple(missing),
            decision=decision,
            chunk_tiers=tiers,
            fallback_reason=CACHE_MISS if prompt.chunks else NO_KNOWN_CHUNK,
            fallback_message=f"no chunk to fuse: {what}; precompute the chunks first",
        )
    return PrefillPlan(
        prompt,
        mode,
        mode,
        tuple(found),
        schedule,
        ratio,
        tuple(missing),
        decision,
        load_ms=_ms_since(t_load),
        chunk_tiers=tiers,
    )


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def full_prefill(
    model: PreTrainedModel, device: torch.device, ids: Sequence[int], stats: BlendStats
) -> Prefill:
    """Plain HF prefill of ``ids`` on ``device``: first-token logits and HF's cache."""
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([list(ids)], device=device), use_cache=True, logits_to_keep=1
        )
    return Prefill(out.logits[0, -1].float(), out.past_key_values, list(ids), stats)


def fused_prefill(
    model: PreTrainedModel,
    layers: LayerwiseModel,
    plan: PrefillPlan,
    stats: BlendStats,
    loaded: Iterable[tuple[int, torch.Tensor, torch.Tensor]],
    selector: TokenSelector,
    *,
    native: NativeKernels | None,
    gpu_path: bool,
    kernels: LayerKernels | None,
) -> Prefill:
    """The fusor over ``plan``'s segments and schedule (``loaded``: their cached K/V layer by
    layer, ``ChunkCache.loader``); the fused K/V become the prompt's HF cache."""
    fusion = fuse(
        layers,
        plan.segments,
        loaded,
        plan.fusor_schedule,
        selector,
        native=native,
        gpu_path=gpu_path,
        kernels=kernels,
    )
    stats.recomputed_fraction = fusion.recomputed_fraction
    cache = dynamic_cache_of(model.config, fusion.keys, fusion.values)
    fusion.keys, fusion.values = [], []  # now owned by the cache; do not keep two copies
    return Prefill(fusion.logits, cache, plan.prompt.ids, stats, fusion)


__all__ = ["PrefillPlan", "full_prefill", "fused_prefill", "plan_prefill"]
