"""Selection options around any token selector: chunk starts, adaptive ratio, temperature.

The fusor asks three things of a selector beyond its scores, each through a function here so
that a plain selector (scores only) keeps working unchanged:

- :func:`observe`: selectors with multi-layer signals see every layer up to the last check
  layer (:class:`LayerObserver`);
- :func:`choose_rows`: which candidates a check layer keeps for a row budget (top-k unless a
  :class:`SelectorWithOptions` says otherwise);
- :func:`cached_key_temper`: how attention tempers the rows still served from the cache
  (APE), :class:`CachedKeyTemperature`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from ragblend.errors import RagblendError
from ragblend.fusion import rows as prompt_rows  # its ``upload``, as gpu_ops counts it
from ragblend.fusion.attention import RowAttentionPlan, attend_rows
from ragblend.fusion.selectors import SELECTORS, CheckLayer, TokenSelector

if TYPE_CHECKING:
    from ragblend.config import BlendConfig
    from ragblend.fusion.rows import PromptRows


@runtime_checkable
class LayerObserver(Protocol):
    """A selector that wants to see every layer up to the last check layer, not only them."""

    def observe(self, check: CheckLayer) -> None:
        """Record what later check layers need (in ``check.memory``)."""


def observe(selector: TokenSelector | None, check: CheckLayer) -> None:
    """Show ``check`` to ``selector`` if it observes layers."""
    if isinstance(selector, LayerObserver):
        selector.observe(check)


def last_observed_layer(selector: TokenSelector | None, check_layers: Iterable[int]) -> int:
    """The last layer the fusor must show ``selector`` (-1: only its check layers).

    A :class:`SelectorWithOptions` observes only when the selector it wraps does: showing layers
    costs the fusor a rotated copy of the cached keys and a :class:`CheckLayer` per layer.
    """
    inner = selector.inner if isinstance(selector, SelectorWithOptions) else selector
    if not isinstance(inner, LayerObserver):
        return -1
    return max(check_layers, default=-1)


def top_rows(scores: torch.Tensor, budget: int) -> torch.Tensor:
    """Indices of the ``budget`` highest ``scores`` [m] (empty for a budget of 0)."""
    if budget <= 0:
        return torch.zeros(0, dtype=torch.long, device=scores.device)
    return torch.topk(scores, min(budget, scores.numel())).indices


def choose_rows(
    selector: TokenSelector, check: CheckLayer, scores: torch.Tensor, budget: int
) -> torch.Tensor:
    """Local indices into ``check.candidates`` a check layer keeps, given ``scores`` [m]."""
    if isinstance(selector, SelectorWithOptions):
        return selector.choose(check, scores, budget)
    return top_rows(scores, budget)


def cached_key_temper(
    selector: TokenSelector | None, rows: PromptRows, one_pass: bool = False
) -> CachedKeyTemperature | None:
    """The attention temperature of ``selector``'s options for this prompt, or ``None`` when
    no temperature is set (T = 1); ``one_pass``: see :class:`CachedKeyTemperature`."""
    if not isinstance(selector, SelectorWithOptions) or selector.cached_temperature == 1.0:
        return None
    return CachedKeyTemperature(
        selector.cached_temperature, rows.cached & ~rows.exact, one_pass=one_pass
    )


class CachedKeyTemperature:
    """APE's temperature T on rows still served from the cache: attention logits to rows with
    a non-exact cache that were not recomputed on the layer are divided by T.

    Applied through SDPA's scale (every logit × 1/T) while the other rows' keys are multiplied
    by T. By default they are multiplied in place for the call and restored bit for bit after
    it: O(recomputed rows) work per layer (four small kernels), the CPU's way. ``one_pass``:
    one scaled copy of every key instead (one kernel, whose per-row factor is made once per
    selection: a GPU's way, where launches cost more than bytes); the same values bit for bit.
    The keys kept for decoding stay the model's. In bf16/fp16 the keys × T round once, so the
    unscaled rows' logits carry that rounding. ``approximate`` is bool [N]: rows with a
    non-exact cache.
    """

    def __init__(
        self, temperature: float, approximate: torch.Tensor, one_pass: bool = False
    ) -> None:
        self.temperature = float(temperature)
        self.approximate = approximate
        self.one_pass = one_pass
        self._computed: torch.Tensor | None = None
        self._unscaled: torch.Tensor | None = None
        self._factors: torch.Tensor | None = None

    def stale_rows(self, computed: torch.Tensor, stale: int | None = None) -> torch.Tensor | None:
        """Bool [N]: rows still served from the cache when ``computed`` rows were recomputed
        on the layer, or ``None`` when there are none (nothing to temper). ``stale``: how many
        there are, when the caller knows: then nothing is read back from the device (no host
        sync on a GPU)."""
        rows = self.approximate.clone()
        rows[computed] = False
        return rows if (bool(rows.any()) if stale is None else stale > 0) else None

    def unscaled_rows(
        self, computed: torch.Tensor, stale: int | None = None
    ) -> torch.Tensor | None:
        """Indices of the rows whose logits keep scale 1 (see :meth:`stale_rows`), made once
        per selection."""
        if self._computed is not computed:  # the active rows change only at check layers
            rows = self.stale_rows(computed, stale)
            if rows is None:
                self._unscaled = None
            elif stale is None:
                self._unscaled = (~rows).nonzero().squeeze(1)
            else:
                self._unscaled = (~rows).nonzero_static(size=rows.numel() - stale).squeeze(1)
            self._computed = computed
        return self._unscaled

    def key_factors(self, computed: torch.Tensor, stale: int | None = None) -> torch.Tensor | None:
        """fp32 [1, 1, N, 1]: T on rows whose logits keep scale 1, 1 on stale rows (see
        :meth:`stale_rows`), made once per selection."""
        if self._computed is not computed:
            rows = self.stale_rows(computed, stale)
            self._factors = None
            if rows is not None:
                one = torch.ones((), device=rows.device)
                self._factors = torch.where(rows, one, self.temperature).view(1, 1, -1, 1)
            self._computed = computed
        return self._factors

    def attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        plan: RowAttentionPlan,
        scaling: float,
        computed: torch.Tensor,
        stale: int | None = None,
    ) -> torch.Tensor:
        """:func:`attend_rows` with stale rows' logits divided by T; ``keys`` [1, Hkv, N, d]
        is modified during the call and holds its own values again when it returns.
        ``stale``: see :meth:`unscaled_rows`."""
        if self.one_pass:
            factors = self.key_factors(computed, stale)
            if factors is None:
                return attend_rows(q, keys, values, plan, scaling)
            scaled = torch.empty_like(keys)
            torch.mul(keys, factors, out=scaled)  # in fp32, rounded once: as ``keys * T``
            return attend_rows(q, scaled, values, plan, scaling / self.temperature)
        rows = self.unscaled_rows(computed, stale)
        if rows is None:
            return attend_rows(q, keys, values, plan, scaling)
        original = keys.index_select(2, rows)
        keys.index_copy_(2, rows, original * self.temperature)
        try:
            return attend_rows(q, keys, values, plan, scaling / self.temperature)
        finally:
            keys.index_copy_(2, rows, original)


class SelectorWithOptions:
    """A selector with the selection options of a :class:`BlendConfig` applied around it
    (its chunk starts and rows near the question, and its ``selection`` policy's levers).

    chunk_start_tokens: the first k rows of every cached chunk (the per-chunk attention sinks
        that independent precompute creates; EPIC) are always kept at every check layer —
        inside the row budget when it is large enough, on top of it otherwise.
    near_question_tokens: the last k cached rows before the question are kept at every check
        layer after the chunk starts, closest to the question first, inside the row budget
        (never on top of it: a short prompt's budget is not spent on them alone).
    adaptive_mass: instead of the scheduled budget, keep the fewest top-scored rows whose
        scores cover this share of the candidates' score mass, clamped to ``adaptive_ratio``
        × the check layer's scale × the cached rows.
    cached_temperature: see :func:`cached_key_temper`.
    fitted_chunk_weight: the scores of rows in a chunk that *fits* its place (its cache was
        precomputed after the chunk before it in the prompt, ``Segment.fits``) are multiplied
        by this (every selector here scores >= 0; at 0 they come after every other row, in
        their score order); below 1 their chunk starts are not always kept either. Rows near
        the question are kept as for any chunk.
    """

    def __init__(
        self,
        inner: TokenSelector,
        *,
        chunk_start_tokens: int = 0,
        near_question_tokens: int = 0,
        adaptive_mass: float | None = None,
        adaptive_ratio: tuple[float, float] = (0.05, 0.3),
        check_scales: dict[int, float] | None = None,
        cached_temperature: float = 1.0,
        fitted_chunk_weight: float = 1.0,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.chunk_start_tokens = chunk_start_tokens
        self.near_question_tokens = near_question_tokens
        self.adaptive_mass = adaptive_mass
        self.adaptive_ratio = adaptive_ratio
        self.check_scales = check_scales or {}
        self.cached_temperature = cached_temperature
        self.fitted_chunk_weight = float(fitted_chunk_weight)

    @classmethod
    def wrap(cls, inner: TokenSelector, config: BlendConfig) -> TokenSelector:
        """``inner`` wrapped with ``config``'s options (its chunk starts, rows near the
        question and ``selection`` policy), or ``inner`` itself when none is on."""
        policy = config.selection
        if (
            not config.chunk_start_tokens
            and not config.near_question_tokens
            and policy.adaptive_mass is None
            and policy.cached_temperature == 1.0
            and policy.fitted_chunk_weight == 1.0
        ):
            return inner
        scales = config.check_scales or (1.0,) * len(config.check_layers)
        return cls(
            inner,
            chunk_start_tokens=config.chunk_start_tokens,
            near_question_tokens=config.near_question_tokens,
            adaptive_mass=policy.adaptive_mass,
            adaptive_ratio=(float(policy.adaptive_ratio[0]), float(policy.adaptive_ratio[1])),
            check_scales=dict(zip(config.check_layers, scales)),
            cached_temperature=policy.cached_temperature,
            fitted_chunk_weight=policy.fitted_chunk_weight,
        )

    def observe(self, check: CheckLayer) -> None:
        observe(self.inner, check)

    def scores(self, check: CheckLayer) -> torch.Tensor:
        return self.inner.scores(check)

    def always_kept(self, check: CheckLayer) -> tuple[torch.Tensor, int]:
        """The rows kept before any scored row, made once per prefill (``check.memory``) in
        one host pass over the prompt's lists: a priority, fp32 [N] (+inf on chunk starts,
        above every finite score and higher the closer to the question on the rows near it,
        -inf elsewhere; uploaded in one copy), and how many chunk starts may be chosen
        (cached, not exact, not forced). Every such start is still active at a later check
        layer, since each check layer keeps them all. A fitted chunk's starts are not kept
        when ``fitted_chunk_weight`` < 1."""
        memory = check.memory
        if "always_kept" not in memory:
            prompt = check.prompt
            assert prompt is not None  # only called when the prompt's rows are known
            n = prompt.n
            values = [-math.inf] * n
            starts = 0
            forced = set(prompt.forced_list)
            near = self.near_question_start(prompt, forced)
            offsets = prompt.offset_list
            skip_fitted = self.fitted_chunk_weight < 1.0
            for i in prompt.candidate_list:
                if i in forced:
                    continue
                start = offsets[i] < self.chunk_start_tokens
                if start and not (skip_fitted and prompt.fitted_list[i]):
                    values[i] = math.inf
                    starts += 1
                elif i >= near:
                    values[i] = _NEAR * (1 + i / n)
            host = torch.tensor(values, dtype=torch.float32)
            memory["always_kept"] = (prompt_rows.upload(host, prompt.ids.device), starts)
        return memory["always_kept"]

    def fitted_rows(self, check: CheckLayer) -> torch.Tensor | None:
        """Bool [N]: rows of fitted chunks, made once per prefill (one copy); ``None`` when
        the weight changes no score (1, or no fitted chunk in the prompt)."""
        memory = check.memory
        if "fitted_rows" not in memory:
            prompt = check.prompt
            assert prompt is not None  # only called when the prompt's rows are known
            rows = None
            if self.fitted_chunk_weight != 1.0 and any(prompt.fitted_list):
                host = torch.tensor(prompt.fitted_list, dtype=torch.bool)
                rows = prompt_rows.upload(host, prompt.ids.device)
            memory["fitted_rows"] = rows
        return memory["fitted_rows"]

    def lowered(self, check: CheckLayer, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` [m] (>= 0, fp32) with the fitted chunks' rows lowered: × the weight;
        at 0 mapped to -1 / (1 + score), below every other row and still in score order."""
        fitted = self.fitted_rows(check)
        if fitted is None:
            return scores
        w = self.fitted_chunk_weight
        low = scores * w if w > 0 else -1.0 / (1.0 + scores)
        return torch.where(fitted[check.rows], low, scores)

    def near_question_start(self, prompt: PromptRows, forced: set[int]) -> int:
        """First position of the last ``near_question_tokens`` cached rows before the question
        (counted over candidates not in ``forced``, the prompt's forced rows, so separators
        between chunks do not count)."""
        before = [i for i in prompt.candidate_list if i < prompt.question_start and i not in forced]
        window = before[-self.near_question_tokens :] if self.near_question_tokens else []
        return window[0] if window else prompt.n

    def adaptive_budget(self, check: CheckLayer, scores: torch.Tensor) -> int:
        """Rows whose scores cover ``adaptive_mass`` of the total, clamped to the ratio range."""
        scale = self.check_scales.get(check.layer, 1.0)
        base = check.prompt.num_approx if check.prompt is not None else scores.numel()
        low, high = (round(r * scale * base) for r in self.adaptive_ratio)
        target = self.adaptive_mass or 0.0  # only called when adaptive_mass is set
        mass = scores.float().clamp_min(0).sort(descending=True).values
        total = float(mass.sum())
        if total > 0:
            covered = torch.cumsum(mass, 0) / total
            needed = int(torch.searchsorted(covered, target)) + 1
        else:
            needed = low
        return max(0, min(scores.numel(), high, max(low, needed)))

    def choose(self, check: CheckLayer, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """Local indices into ``check.candidates``: the chunk starts (on top of the budget
        where it is smaller), then the rows near the question, closest first, then the best
        others by score (× ``fitted_chunk_weight`` in fitted chunks; one ``topk`` with the
        starts and near rows ranked first; its size is known on the host)."""
        if self.adaptive_mass is not None:
            budget = self.adaptive_budget(check, scores)  # reads the scores: a host sync
        if check.prompt is None or not (
            self.chunk_start_tokens or self.near_question_tokens or self.fitted_chunk_weight != 1
        ):
            return top_rows(scores, budget)
        priority, starts = self.always_kept(check)
        finite = scores.float().nan_to_num(nan=torch.finfo(torch.float32).max)
        ranked = torch.maximum(self.lowered(check, finite), priority[check.rows])
        return top_rows(ranked, max(budget, starts))


_NEAR = 1e30  # the score of a row near the question (finite scores are far below)


def make_selector(config: BlendConfig) -> TokenSelector:
    """The selector ``config.selector`` names, built from ``config``.

    With a selection option on (chunk starts, rows near the question, adaptive ratio,
    cached-row temperature) it comes wrapped in a :class:`SelectorWithOptions` that applies them.
    """
    try:
        factory = SELECTORS[config.selector]
    except KeyError:
        raise RagblendError(
            f"unknown selector {config.selector!r}; available: {', '.join(SELECTORS)}"
        ) from None
    return SelectorWithOptions.wrap(factory(config), config)


def __getattr__(name: str) -> object:
    # the wrapper was ``SelectionPolicy`` until that name went to the config value
    # (``ragblend.config.SelectionPolicy``); benchmarks still import it under the old name
    if name == "SelectionPolicy":
        import warnings

        warnings.warn(
            "ragblend.fusion.selection.SelectionPolicy is deprecated: the selector wrapper is "
            "SelectorWithOptions; ragblend.SelectionPolicy is BlendConfig.selection's value",
            DeprecationWarning,
            stacklevel=2,
        )
        return SelectorWithOptions
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
