"""One prompt, one plan: what is looked up, what is recomputed, and why a full prefill runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CHUNKS, QUESTION, tiny_model

from ragblend import BlendConfig, BlendEngine
from ragblend.controller import Decision
from ragblend.decode import BlendStats
from ragblend.errors import CorruptEntryError
from ragblend.prefill import PrefillPlan, plan_prefill
from ragblend.store import MemoryStore


@pytest.fixture
def engine(tokenizer) -> BlendEngine:
    return BlendEngine(tiny_model("llama"), tokenizer, BlendConfig(), MemoryStore())


def decision(ratio: float, fallback: bool = False) -> Decision:
    return Decision(
        ratio=ratio,
        r_star=0.15,
        r_load=0.4,
        tier="disk",
        n_tokens=100,
        t_prefill_ms=10.0,
        t_load_ms=4.0,
        t_recompute_ms=4.0,
        bytes_per_token=1,
        bandwidth_bytes_per_s=1.0,
        fallback_full=fallback,
        reason="loading" if fallback else "",
    )


def never_asked(n_tokens: int) -> Decision:
    raise AssertionError("the controller is asked only for ratio='auto'")


def test_a_blend_plan_names_segments_misses_and_schedule(engine):
    engine.precompute(CHUNKS[:2])
    prompt = engine.tokenize(QUESTION, CHUNKS)
    plan = plan_prefill(engine.chunks, prompt, "blend", 0.3, engine.config, never_asked)
    assert plan.fused and plan.mode == plan.requested == "blend"
    assert plan.missing == (2,) and plan.chunk_hits == 2 and plan.fallback_reason is None
    assert plan.ratio == 0.3 and plan.schedule == tuple(engine.config.schedule(0.3))
    kinds = [s.kind for s in plan.segments]
    assert kinds == ["prefix", "chunk", "separator", "chunk", "separator", "chunk", "tail"]
    assert [s.kv is None for s in plan.segments if s.kind == "chunk"] == [False, False, True]
    assert plan.missed_texts() == [CHUNKS[2]]
    stats = BlendStats(mode="blend")
    plan.record(stats)
    assert (stats.chunk_hits, stats.chunk_misses, stats.ratio) == (2, 1, 0.3)
    assert stats.cached_tokens == plan.cached_tokens > 0 and stats.mode == "blend"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.mode = "full"  # type: ignore[misc]


def test_ratio_one_recomputes_every_row_and_reuse_only_rows_without_a_cache(engine):
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    one = plan_prefill(engine.chunks, prompt, "blend", 1.0, engine.config, never_asked)
    reuse = plan_prefill(engine.chunks, prompt, "reuse", None, engine.config, never_asked)
    prefix = plan_prefill(engine.chunks, prompt, "prefix", None, engine.config, never_asked)
    assert one.schedule is None and one.fusor_schedule is None and one.ratio == 1.0
    assert reuse.schedule == () and reuse.fusor_schedule == [] and reuse.ratio is None
    assert prefix.schedule is None and prefix.missing is None
    assert [s.kind for s in prefix.segments] == ["prefix", "rest"]
    full = plan_prefill(engine.chunks, prompt, "full", None, engine.config, never_asked)
    assert not full.fused and full.segments == () and full.fallback_reason is None


def test_a_plan_with_no_cached_chunk_falls_back_and_says_why(engine):
    prompt = engine.tokenize(QUESTION, CHUNKS)
    plan = plan_prefill(engine.chunks, prompt, "blend", 0.3, engine.config, never_asked)
    assert plan.mode == "full" and plan.requested == "blend" and not plan.fused
    assert plan.fallback_reason == "cache_miss" and plan.missing == (0, 1, 2)
    stats = BlendStats(mode="blend")
    plan.record(stats)
    assert stats.mode == "full" and stats.fallback_reason == "cache_miss"
    assert stats.ratio is None and stats.chunk_misses == 3
    assert "every chunk missed" in (stats.fallback_message or "")
    out = engine.prefill(prompt, mode="blend", ratio=0.3)
    assert out.stats.fallback_message == stats.fallback_message and out.fusion is None


def test_the_controller_is_asked_once_and_its_fallback_skips_the_lookup(engine):
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    asked: list[int] = []

    def decide(n_tokens: int) -> Decision:
        asked.append(n_tokens)
        return decision(0.4)

    plan = plan_prefill(engine.chunks, prompt, "blend", "auto", engine.config, decide)
    assert asked == [len(prompt)] and plan.ratio == 0.4 and plan.decision == decision(0.4)
    again = plan.looked_up_again(engine.chunks)
    assert asked == [len(prompt)]  # the decision is kept, not made again
    assert again.ratio == plan.ratio and again.schedule == plan.schedule
    assert again.decision is plan.decision
    engine.store = Unreadable()
    slow = plan_prefill(
        engine.chunks, prompt, "blend", "auto", engine.config, lambda n: decision(1.0, True)
    )
    assert slow.mode == "full" and slow.fallback_reason == "controller_full"
    assert slow.missing is None and "longer than a full prefill" in (slow.fallback_message or "")


class Unreadable(MemoryStore):
    """A store no plan may read."""

    def get(self, key: str):
        raise AssertionError("a controller fallback looks nothing up")


class FailingOnce:
    """A stored entry whose layer 1 fails verification (as a damaged disk entry's does)."""

    def __init__(self, inner, key: str) -> None:
        self.inner, self.key = inner, key
        self.meta = inner.meta

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def layer(self, index: int):
        if index == 1:
            raise CorruptEntryError(self.key, "checksum mismatch in layer 1")
        return self.inner.layer(index)


def test_a_corrupt_entry_is_dropped_and_the_prompt_planned_once_more(engine, monkeypatch):
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    key = engine.chunk_key(
        context_ids=engine.chunks.context_ids(prompt.head), chunk_ids=prompt.chunks[1]
    )
    store, stored_get = engine.store, engine.store.get

    def get(k: str):
        kv = stored_get(k)
        return FailingOnce(kv, k) if k == key and kv is not None else kv

    monkeypatch.setattr(store, "get", get)
    replans: list[PrefillPlan] = []
    looked_up_again = PrefillPlan.looked_up_again

    def spy(plan: PrefillPlan, chunks) -> PrefillPlan:
        replans.append(plan)
        return looked_up_again(plan, chunks)

    monkeypatch.setattr(PrefillPlan, "looked_up_again", spy)
    missed: list[str] = []
    engine.on_miss = missed.extend
    out = engine.prefill(prompt, mode="blend", ratio=0.5)
    assert len(replans) == 1 and replans[0].missing == ()
    assert key not in engine.store
    assert (out.stats.chunk_hits, out.stats.chunk_misses) == (2, 1) and out.stats.mode == "blend"
    assert missed == [CHUNKS[1]]  # the new plan's miss, announced once
    again = engine.prefill(prompt, mode="blend", ratio=0.5)  # the entry is simply absent now
    assert torch.equal(out.logits, again.logits) and len(replans) == 1
