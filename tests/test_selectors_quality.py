"""Selection options beyond KV deviation: chunk starts, relevance, temperature, adaptive."""

from __future__ import annotations

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import assert_matches_hf, engine_for, fuse_prompt, hf_forward

from ragblend import BlendConfig, SelectionPolicy
from ragblend.errors import RagblendError
from ragblend.fusion.attention import RowAttentionPlan, attend_rows
from ragblend.fusion.rows import prompt_rows
from ragblend.fusion.selection import (
    CachedKeyTemperature,
    SelectorWithOptions,
    cached_key_temper,
    last_observed_layer,
)
from ragblend.fusion.selectors import QuestionRelevanceSelector, RandomSelector
from ragblend.fusion.trace import SelectionTrace

ATOL = 1e-4
PLAIN = dict(chunk_start_tokens=0, near_question_tokens=0)  # the selector's rows alone
EVERY_OPTION = dict(
    selector="relevance-kv",
    chunk_start_tokens=4,
    selection=SelectionPolicy(
        cached_temperature=1.3, adaptive_mass=0.6, adaptive_ratio=(0.05, 0.5)
    ),
)


def _temperature(t: float) -> SelectionPolicy:
    return SelectionPolicy(cached_temperature=t)


def _fused(engine, selector=None, ratio=None, trace=None):
    ratio = engine.config.ratio if ratio is None else ratio
    return fuse_prompt(engine, engine.tokenize(QUESTION, CHUNKS), ratio, trace, selector)


def _chunk_starts(segments, k: int) -> set[int]:
    starts, pos = set(), 0
    for seg in segments:
        if seg.kind == "chunk" and seg.kv is not None:
            starts |= set(range(pos, pos + min(k, len(seg))))
        pos += len(seg)
    return starts


@pytest.mark.parametrize("selector", ["random", "kv-deviation", "relevance"])
@pytest.mark.parametrize("ratio", [0.0, 0.1])
def test_chunk_starts_are_recomputed_on_every_layer_after_each_check_layer(
    tokenizer, selector, ratio
):
    k = 3
    engine = engine_for(
        tiny_model("llama", num_hidden_layers=4),
        tokenizer,
        selector=selector,
        chunk_start_tokens=k,
        check_layers=(0, 2),
        check_scales=(2.0, 1.0),
        exact_first_chunk=False,  # every chunk has starts to recompute
    )
    engine.precompute(CHUNKS)
    trace = SelectionTrace()
    out, segments = _fused(engine, ratio=ratio, trace=trace)
    starts = _chunk_starts(segments, k)
    assert len(starts) == k * len(CHUNKS)
    rows = prompt_rows(segments, "cpu")
    forced = int(rows.forced.sum())
    for layer, scale in ((0, 2.0), (2, 1.0)):
        kept = set(trace.selections[layer].tolist())
        assert starts <= kept
        budget = round(ratio * scale * rows.num_approx)
        assert len(kept) == forced + max(budget, len(starts))
    assert starts <= set(out.selected.tolist())
    assert out.rows_per_layer[3] == out.selected.numel()


def test_relevance_scores_are_hf_question_attention_summed_up_to_the_check_layer(tokenizer):
    """Before the first check layer every row is fresh, so the fused question attention equals
    HF's eager attention of the question rows, renormalised over the keys before them."""
    model = tiny_model("llama", num_hidden_layers=3, attn_implementation="eager")
    engine = engine_for(
        model, tokenizer, selector="relevance", check_layers=(1,), check_scales=None, ratio=0.2
    )
    engine.precompute(CHUNKS)
    trace = SelectionTrace()
    _, segments = _fused(engine, trace=trace)
    rows = prompt_rows(segments, "cpu")
    prompt = engine.tokenize(QUESTION, CHUNKS)
    with torch.inference_mode():
        attentions = model(torch.tensor([prompt.ids]), output_attentions=True).attentions
    qs = rows.question_start
    expected = torch.zeros(qs)
    for layer in (0, 1):
        a = attentions[layer][0, :, qs:, :qs].float()
        expected += (a / a.sum(-1, keepdim=True)).mean(dim=(0, 1))
    free = ~rows.forced[rows.candidates]
    got = trace.scores[1][free]
    torch.testing.assert_close(got, expected[rows.candidates[free]], atol=1e-5, rtol=1e-4)


def test_relevance_kv_combinations_rank_rows_that_are_relevant_and_deviating(tokenizer):
    engine = engine_for(
        tiny_model("qwen2"), tokenizer, ratio=0.2, check_layers=(1,), check_scales=None, **PLAIN
    )
    engine.precompute(CHUNKS)
    kept = {}
    for name in ("relevance", "kv-deviation", "relevance-kv", "relevance-kv-product"):
        trace = SelectionTrace()
        _fused(engine.with_config(selector=name), trace=trace)
        kept[name] = set(trace.selections[1].tolist())
    assert kept["relevance-kv"] != kept["relevance"]
    assert kept["relevance-kv"] != kept["kv-deviation"]
    # a rank-sum pick shares rows with both of its signals
    assert kept["relevance-kv"] & (kept["relevance"] - kept["kv-deviation"])
    assert kept["relevance-kv"] & (kept["kv-deviation"] - kept["relevance"])


def test_temper_divides_only_logits_to_rows_still_served_from_the_cache(tokenizer):
    engine = engine_for(tiny_model("llama"), tokenizer)
    engine.precompute(CHUNKS)
    segments, _ = engine.chunks.lookup(engine.tokenize(QUESTION, CHUNKS))
    rows = prompt_rows(segments, "cpu")
    policy = SelectorWithOptions(RandomSelector(), cached_temperature=2.0)
    temper = cached_key_temper(policy, rows)
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, rows.n, 16), torch.randn(1, 2, rows.n, 16)
    computed = rows.candidates[::3]
    q = torch.randn(1, 4, computed.numel(), 16)
    plan = RowAttentionPlan(computed, 2, q.dtype, None)
    before = keys.clone()
    got = temper.attend(q, keys, values, plan, 0.25, computed)
    assert torch.equal(keys, before)  # restored bit for bit
    stale = rows.cached & ~rows.exact
    stale[computed] = False
    divided = keys.clone()
    divided[:, :, stale] /= 2.0  # the definition: stale rows' keys, hence logits, divided by T
    torch.testing.assert_close(
        got, attend_rows(q, divided, values, plan, 0.25), atol=1e-5, rtol=1e-5
    )
    every = rows.candidates  # nothing left stale: plain attention, untouched
    plan = RowAttentionPlan(every, 2, q.dtype, None)
    q = torch.randn(1, 4, every.numel(), 16)
    assert torch.equal(
        temper.attend(q, keys, values, plan, 0.25, every), attend_rows(q, keys, values, plan, 0.25)
    )
    off = SelectorWithOptions(RandomSelector(), cached_temperature=1.0)
    assert cached_key_temper(off, rows) is None


def test_cached_temperature_changes_the_prefill_but_keeps_decode_kv_unscaled(tokenizer):
    engine = engine_for(
        tiny_model("llama", num_hidden_layers=4),
        tokenizer,
        ratio=0.1,
        check_layers=(1,),
        check_scales=None,
        **PLAIN,
    )
    engine.precompute(CHUNKS)
    plain, _ = _fused(engine.with_config(selection=_temperature(1.0)))
    same, _ = _fused(engine.with_config(selection=_temperature(1.0), chunk_start_tokens=0))
    assert torch.equal(plain.logits, same.logits)
    hot, _ = _fused(engine.with_config(selection=_temperature(2.0)))
    assert torch.equal(hot.selected, plain.selected)  # selection happens before any tempering
    assert not torch.allclose(hot.logits, plain.logits)
    stale = torch.ones(plain.keys[0].shape[2], dtype=torch.bool)
    stale[plain.selected] = False
    for layer in (2, 3):  # rows not recomputed keep their cached keys, unscaled
        assert torch.equal(hot.keys[layer][:, :, stale], plain.keys[layer][:, :, stale])


def test_cached_temperature_is_a_blend_option_and_leaves_full_kv_reuse_alone(tokenizer):
    engine = engine_for(tiny_model("llama"), tokenizer, selection=_temperature(1.0))
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    reuse = engine.prefill(prompt, "reuse").logits
    hot = engine.with_config(selection=_temperature(2.0))
    assert torch.equal(hot.prefill(prompt, "reuse").logits, reuse)
    blend = engine.prefill(prompt, "blend").logits
    assert not torch.equal(hot.prefill(prompt, "blend").logits, blend)


def test_options_around_a_one_layer_selector_do_not_make_the_fusor_show_it_every_layer():
    plain = SelectorWithOptions(RandomSelector(), cached_temperature=1.06, chunk_start_tokens=4)
    assert last_observed_layer(plain, (1, 10)) == -1
    relevance = SelectorWithOptions(QuestionRelevanceSelector(), cached_temperature=1.06)
    assert last_observed_layer(relevance, (1, 10)) == 10


class PeakedSelector:
    """All score mass on the first three candidates."""

    name = "peaked"

    def scores(self, check):
        s = torch.zeros(check.candidates.numel())
        s[:3] = 1.0
        return s


def test_adaptive_ratio_keeps_the_rows_covering_the_mass_within_the_ratio_bounds(tokenizer):
    engine = engine_for(
        tiny_model("llama"), tokenizer, ratio=0.2, check_layers=(1,), check_scales=None
    )
    engine.precompute(CHUNKS)
    segments, _ = engine.chunks.lookup(engine.tokenize(QUESTION, CHUNKS))
    rows = prompt_rows(segments, "cpu")
    forced = int(rows.forced.sum())

    def kept(selector, mass, bounds):
        policy = SelectorWithOptions(selector, adaptive_mass=mass, adaptive_ratio=bounds)
        out, _ = _fused(engine, selector=policy)
        return out.selected.numel() - forced

    assert kept(PeakedSelector(), 0.9, (0.0, 1.0)) == 3
    assert kept(PeakedSelector(), 0.9, (0.1, 1.0)) == round(0.1 * rows.num_approx)
    uniform = kept(RandomSelector(), 0.5, (0.0, 1.0))
    assert 0.2 * rows.num_approx < uniform < 0.8 * rows.num_approx  # random scores: ~half
    assert kept(RandomSelector(), 0.99, (0.0, 0.25)) == round(0.25 * rows.num_approx)


@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_one_with_every_option_on_equals_hf_full_prefill(tokenizer, family):
    engine = engine_for(tiny_model(family), tokenizer, ratio=1.0, **EVERY_OPTION)
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    out = engine.prefill(prompt, "blend")
    assert out.stats.recomputed_fraction == 1.0
    assert_matches_hf(out, hf_forward(engine.model, prompt.ids), range(3), atol=ATOL)


def test_every_option_on_at_a_low_ratio_runs_and_recomputes_a_share(tokenizer):
    engine = engine_for(tiny_model("qwen3"), tokenizer, ratio=0.15, **EVERY_OPTION)
    engine.precompute(CHUNKS)
    out = engine.prefill(engine.tokenize(QUESTION, CHUNKS), "blend")
    assert 0.0 < out.stats.recomputed_fraction < 1.0
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize(
    "bad",
    [
        {"chunk_start_tokens": -1},
        {"chunk_start_tokens": 1.5},
        {"cached_temperature": 0.0},
        {"adaptive_mass": 1.5},
        {"adaptive_mass": 0.0},
        {"adaptive_ratio": (0.3, 0.1)},
        {"adaptive_ratio": (0.1,)},
    ],
)
def test_bad_selection_options_are_one_clear_error(bad):
    name = next(iter(bad))
    with pytest.raises(RagblendError, match=name):
        if name in ("chunk_start_tokens", "near_question_tokens"):
            BlendConfig(**bad)
        else:
            BlendConfig(selection=SelectionPolicy(**bad))


def test_relevance_selector_without_observed_layers_uses_the_check_layer_alone(tokenizer):
    engine = engine_for(
        tiny_model("llama"), tokenizer, ratio=0.2, check_layers=(1,), check_scales=None
    )
    engine.precompute(CHUNKS)
    trace_one, trace_all = SelectionTrace(), SelectionTrace()
    _fused(engine, selector=_OnlyScores(), trace=trace_one)
    _fused(engine.with_config(selector="attention"), trace=trace_all)
    assert torch.allclose(trace_one.scores[1], trace_all.scores[1], atol=1e-6)


class _OnlyScores:
    """The relevance selector seen through a plain (non-observing) selector interface."""

    name = "relevance-check-only"

    def __init__(self) -> None:
        self.inner = QuestionRelevanceSelector()

    def scores(self, check):
        return self.inner.scores(check)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temper_in_one_pass_equals_the_in_place_temper_bit_for_bit(dtype, tokenizer):
    engine = engine_for(tiny_model("llama"), tokenizer)
    engine.precompute(CHUNKS)
    segments, _ = engine.chunks.lookup(engine.tokenize(QUESTION, CHUNKS))
    rows = prompt_rows(segments, "cpu")
    approximate = rows.cached & ~rows.exact
    torch.manual_seed(0)
    keys = torch.randn(1, 2, rows.n, 16).to(dtype)
    values = torch.randn(1, 2, rows.n, 16).to(dtype)
    for computed in (rows.candidates[::3], rows.candidates):
        q = torch.randn(1, 4, computed.numel(), 16).to(dtype)
        plan = RowAttentionPlan(computed, 2, q.dtype, None)
        stale = int((approximate & ~torch.isin(torch.arange(rows.n), computed)).sum())
        in_place = CachedKeyTemperature(1.06, approximate)
        one_pass = CachedKeyTemperature(1.06, approximate, one_pass=True)
        want = in_place.attend(q, keys, values, plan, 0.25, computed)
        before = keys.clone()
        for counted in (None, stale):  # counted on the device, or given by the host
            fresh = CachedKeyTemperature(1.06, approximate, one_pass=True)
            assert torch.equal(fresh.attend(q, keys, values, plan, 0.25, computed, counted), want)
        assert torch.equal(one_pass.attend(q, keys, values, plan, 0.25, computed), want)
        assert torch.equal(keys, before)  # the model's keys untouched
