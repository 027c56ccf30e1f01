"""Token selectors: which cached rows to recompute at a check layer (HKVD tokens)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from ragblend.errors import RagblendError
from ragblend.models.adapters import LayerProjections

if TYPE_CHECKING:
    from ragblend.config import BlendConfig
    from ragblend.fusion.rows import PromptRows


@dataclass(frozen=True)
class CheckLayer:
    """What a selector sees at a check layer.

    ``candidates`` are local indices into ``active`` (the rows computed on this layer) that
    have a cached KV and may be chosen (not forced); the properties give their fresh and cached
    pre-RoPE K and V, [1, kv_heads, m, head_dim]. ``prompt`` is the prompt's row bookkeeping;
    ``memory`` is one fused prefill's scratch space, shared by the layers a selector observes
    (multi-layer signals), empty at the start of every prefill.
    """

    layer: int
    proj: LayerProjections
    cached_k_all: torch.Tensor  # [1, Hkv, N, d] pre-RoPE, whole prompt
    cached_v_all: torch.Tensor
    keys_all: torch.Tensor  # [1, Hkv, N, d] post-RoPE cached keys (fresh rows not yet written)
    active: torch.Tensor  # original positions of the rows computed on this layer
    tail_start: int  # first position of the question (uncached tail)
    scaling: float
    candidates: torch.Tensor  # local indices into ``active`` that may be chosen
    prompt: PromptRows | None = None
    memory: dict = field(default_factory=dict)

    @classmethod
    def build(
        cls,
        layer: int,
        proj: LayerProjections,
        cached_k: torch.Tensor,
        cached_v: torch.Tensor,
        keys: torch.Tensor,
        active: torch.Tensor,
        rows: PromptRows,
        scaling: float,
        memory: dict | None = None,
        free: int | None = None,
    ) -> CheckLayer:
        """The check layer for rows ``active`` of a prompt with ``rows``; ``free``: how many
        of them are not forced, when the caller knows (then no host sync on a GPU)."""
        not_forced = ~rows.forced[active]
        if free is None:
            candidates = not_forced.nonzero().squeeze(1)
        else:
            candidates = not_forced.nonzero_static(size=free).squeeze(1)
        return cls(
            layer,
            proj,
            cached_k,
            cached_v,
            keys,
            active,
            rows.question_start,
            scaling,
            candidates,
            rows,
            {} if memory is None else memory,
        )

    @property
    def rows(self) -> torch.Tensor:
        return self.active[self.candidates]

    @property
    def fresh_k(self) -> torch.Tensor:
        return self.proj.k_pre[:, :, self.candidates]

    @property
    def fresh_v(self) -> torch.Tensor:
        return self.proj.v[:, :, self.candidates]

    @property
    def cached_k(self) -> torch.Tensor:
        return self.cached_k_all[:, :, self.rows]

    @property
    def cached_v(self) -> torch.Tensor:
        return self.cached_v_all[:, :, self.rows]

    def question_attention(self) -> torch.Tensor:
        """Attention mass [m] the question's rows give each candidate on this layer.

        Uses the fresh queries of the question rows and the keys before the question (fresh
        where computed on this layer, cached elsewhere), softmax over those keys, averaged
        over heads and question rows.
        """
        return self.question_attention_by_position()[self.rows]

    def question_attention_by_position(self) -> torch.Tensor:
        """:meth:`question_attention` for every position before the question, [tail_start]."""
        q = self.proj.q
        tail = int((self.active >= self.tail_start).sum())
        heads, dim = q.shape[1], q.shape[3]
        kv_heads = self.keys_all.shape[1]
        keys = self.keys_all[:, :, : self.tail_start].clone()
        computed = self.active < self.tail_start
        keys[:, :, self.active[computed]] = self.proj.k[:, :, computed]
        qt = q[:, :, q.shape[2] - tail :].reshape(1, kv_heads, (heads // kv_heads) * tail, dim)
        probs = torch.softmax((qt.float() @ keys.float().transpose(-1, -2)) * self.scaling, -1)
        return probs.mean(dim=(0, 1, 2))


class TokenSelector(Protocol):
    """Scores candidate rows at a check layer; higher score → recomputed first."""

    name: str

    def scores(self, check: CheckLayer) -> torch.Tensor:
        """Scores [m] for ``check.candidates``."""


class KVDeviationSelector:
    """HKVD: squared L2 distance between fresh and cached K and/or V, fp32, heads × dims."""

    name = "kv-deviation"

    def __init__(self, deviation: str = "kv") -> None:
        self.deviation = deviation

    @staticmethod
    def distance(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        return _squared_distance(fresh, cached)

    def scores(self, check: CheckLayer) -> torch.Tensor:
        total: torch.Tensor | None = None
        if "k" in self.deviation:
            total = self.distance(check.fresh_k, check.cached_k)
        if "v" in self.deviation:
            dv = self.distance(check.fresh_v, check.cached_v)
            total = dv if total is None else total + dv
        if total is None:
            raise RagblendError(f"deviation {self.deviation!r} names neither 'k' nor 'v'")
        return total


class RelativeKVDeviationSelector(KVDeviationSelector):
    """KV deviation relative to the cached vector's norm (scale-free per token)."""

    name = "kv-relative"

    @staticmethod
    def distance(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
        return _relative_distance(fresh, cached)


class QuestionAttentionSelector:
    """Rows the question attends to most on the check layer (query-aware, no deviation)."""

    name = "attention"

    def scores(self, check: CheckLayer) -> torch.Tensor:
        return check.question_attention()


class DeviationTimesAttentionSelector(KVDeviationSelector):
    """KV deviation weighted by the question's attention: deviating rows that matter."""

    name = "kv-attention"

    def scores(self, check: CheckLayer) -> torch.Tensor:
        attention = check.question_attention()
        return super().scores(check) * (attention / attention.mean().clamp_min(1e-12))


class QuestionRelevanceSelector:
    """Question attention fused over every layer up to the check layer (ProphetKV / A³-like).

    The fusor shows the selector every layer from 0 to its last check layer (``observe``): on
    each, the question rows' fresh post-RoPE queries attend over the keys before the question
    (fresh where computed on that layer, cached elsewhere). The per-position attention is
    summed over the layers seen so far, so a check layer ranks rows by the relevance the
    question has shown them on all earlier layers, not on one layer alone.
    """

    name = "relevance"

    def observe(self, check: CheckLayer) -> None:
        seen: set[int] = check.memory.setdefault("relevance_layers", set())
        if check.layer in seen:
            return
        seen.add(check.layer)
        attention = check.question_attention_by_position()
        total = check.memory.get("relevance")
        check.memory["relevance"] = attention if total is None else total + attention

    def scores(self, check: CheckLayer) -> torch.Tensor:
        self.observe(check)
        return check.memory["relevance"][check.rows]


class RelevanceKVSelector(KVDeviationSelector):
    """Multi-layer question relevance combined with the check layer's KV deviation.

    ``combine="rank"`` adds the two rankings (each rank / m, so neither scale dominates);
    ``"product"`` multiplies relevance (normalised to mean 1) by the deviation.
    """

    name = "relevance-kv"

    def __init__(self, deviation: str = "kv", combine: str = "rank") -> None:
        super().__init__(deviation)
        if combine not in ("rank", "product"):
            raise RagblendError(f"combine must be 'rank' or 'product', got {combine!r}")
        self.combine = combine
        self.relevance = QuestionRelevanceSelector()

    def observe(self, check: CheckLayer) -> None:
        self.relevance.observe(check)

    def scores(self, check: CheckLayer) -> torch.Tensor:
        relevance = self.relevance.scores(check).float()
        deviation = super().scores(check)
        if self.combine == "product":
            return deviation * (relevance / relevance.mean().clamp_min(1e-12))
        return _ranks(relevance) + _ranks(deviation)


class ChunkKVSelector(KVDeviationSelector):
    """Whole chunks first: the chunks whose rows deviate most on the check layer (mean KV
    deviation of their candidate rows), each chunk's rows by their own deviation.

    The idea: on neighbour-aware caches the error sits in chunks whose prompt context differs
    from the one they were precomputed in (the first chunk, chunks after a non-neighbour), and
    a chunk recomputed whole keeps its rows consistent with each other. Measured, it did worse
    than scattered rows at equal recompute (docs/neighbour_caches.md); kept as an option.
    Scores are chunk rank + row deviation share (in [0, 0.5]), so a budget of any size takes
    the best chunks in order, the last one partly, by row deviation.
    """

    name = "chunk-kv"

    def scores(self, check: CheckLayer) -> torch.Tensor:
        rows = super().scores(check).float()
        if check.prompt is None:
            return rows
        # a segment starts where a row's offset in its segment is 0
        segment = torch.cumsum(check.prompt.offsets == 0, 0)[check.rows]
        count = int(check.prompt.n) + 1
        means = torch.zeros(count, device=rows.device).scatter_reduce(
            0, segment, rows, "mean", include_self=False
        )
        present = torch.zeros(count, dtype=torch.bool, device=rows.device)
        present[segment] = True
        # integer ranks over every segment, the absent ones lowest (no host sync)
        chunk_rank = _ranks(means.masked_fill(~present, -float("inf"))) * count
        return chunk_rank[segment] + 0.5 * rows / rows.max().clamp_min(1e-12)


class RandomSelector:
    """Uniformly random rows: the control that shows deviation-based selection matters."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def scores(self, check: CheckLayer) -> torch.Tensor:
        m = check.candidates.numel()
        return torch.rand(m, generator=self.generator).to(check.active.device)


def _squared_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    diff = a.float() - b.float()
    # Normalise per layer so K and V deviations are on comparable scales when summed.
    d = diff.pow(2).sum(dim=(0, 1, 3))
    return d / d.mean().clamp_min(1e-12)


def _ranks(scores: torch.Tensor) -> torch.Tensor:
    """Rank of each score in [0, 1): 0 for the lowest, (m-1)/m for the highest."""
    order = torch.argsort(scores)
    ranks = torch.empty_like(scores, dtype=torch.float32)
    ranks[order] = torch.arange(scores.numel(), device=scores.device, dtype=torch.float32)
    return ranks / max(1, scores.numel())


def _relative_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.float(), b.float()
    return (a - b).pow(2).sum(dim=(0, 1, 3)) / b.pow(2).sum(dim=(0, 1, 3)).clamp_min(1e-12)


SelectorFactory = Callable[["BlendConfig"], TokenSelector]

SELECTORS: dict[str, SelectorFactory] = {
    "kv-deviation": lambda config: KVDeviationSelector(config.selection.deviation),
    "kv-relative": lambda config: RelativeKVDeviationSelector(config.selection.deviation),
    "attention": lambda config: QuestionAttentionSelector(),
    "kv-attention": lambda config: DeviationTimesAttentionSelector(config.selection.deviation),
    "random": lambda config: RandomSelector(),
    "chunk-kv": lambda config: ChunkKVSelector(config.selection.deviation),
    "relevance": lambda config: QuestionRelevanceSelector(),
    "relevance-kv": lambda config: RelevanceKVSelector(config.selection.deviation, "rank"),
    "relevance-kv-product": lambda config: RelevanceKVSelector(
        config.selection.deviation, "product"
    ),
}


def register_selector(name: str, factory: SelectorFactory) -> None:
    """Make ``BlendConfig(selector=name)`` build its selector with ``factory(config)``."""
    SELECTORS[name] = factory
