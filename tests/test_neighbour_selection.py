"""Selection for neighbour-aware caches (issue 54): whole chunks by their deviation, rows
near the question always recomputed."""

from __future__ import annotations

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import assert_matches_hf, engine_for, fuse_prompt, hf_forward

from ragblend import BlendConfig
from ragblend.errors import RagblendError
from ragblend.fusion.rows import prompt_rows
from ragblend.fusion.trace import SelectionTrace


def _selection(engine, ratio: float) -> tuple[SelectionTrace, object]:
    trace = SelectionTrace()
    _, segments = fuse_prompt(engine, engine.tokenize(QUESTION, CHUNKS), ratio, trace)
    return trace, prompt_rows(segments, "cpu")


def test_chunk_kv_keeps_whole_chunks_in_order_of_their_mean_deviation(tokenizer):
    """The check layer keeps the chunk whose rows deviate most on average whole, then the
    next chunk's most deviating rows: the row deviations are kv-deviation's on that layer."""
    model = tiny_model("llama", num_hidden_layers=3)
    engine = engine_for(
        model,
        tokenizer,
        check_layers=(1,),
        check_scales=None,
        chunk_start_tokens=0,
        near_question_tokens=0,
    )
    engine.precompute(CHUNKS)
    deviation, rows = _selection(engine.with_config(selector="kv-deviation"), 0.5)
    free = ~rows.forced[rows.candidates]
    candidates = rows.candidates[free]
    scores = deviation.scores[1][free]
    segment = torch.cumsum(rows.offsets == 0, 0)[candidates]
    chunks = sorted(set(segment.tolist()), key=lambda s: -float(scores[segment == s].mean()))
    first, second = (candidates[segment == s] for s in chunks[:2])
    extra = 3
    ratio = (first.numel() + extra) / rows.num_approx
    chosen, _ = _selection(engine.with_config(selector="chunk-kv"), ratio)
    kept = set(chosen.selections[1].tolist()) - set(rows.forced_list)
    second_scores = scores[segment == chunks[1]]
    expected = set(first.tolist()) | set(second[second_scores.topk(extra).indices].tolist())
    assert kept == expected


@pytest.mark.parametrize("family", FAMILIES)
def test_chunk_kv_at_ratio_one_equals_hf_full_prefill(tokenizer, family):
    engine = engine_for(tiny_model(family), tokenizer, ratio=1.0, selector="chunk-kv")
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    out = engine.prefill(prompt, "blend")
    assert out.stats.recomputed_fraction == 1.0
    assert_matches_hf(out, hf_forward(engine.model, prompt.ids), range(3), atol=1e-4)


def test_chunk_kv_at_a_low_ratio_recomputes_its_share(tokenizer):
    engine = engine_for(tiny_model("qwen2"), tokenizer, ratio=0.3, selector="chunk-kv")
    engine.precompute(CHUNKS)
    out = engine.prefill(engine.tokenize(QUESTION, CHUNKS), "blend")
    assert 0.0 < out.stats.recomputed_fraction < 1.0
    assert torch.isfinite(out.logits).all()


def _near_question(rows, k: int) -> set[int]:
    """The last ``k`` cached rows before the question, counted independently of the policy."""
    cached = [i for i in range(rows.question_start) if bool(rows.cached[i])]
    cached = [i for i in cached if not bool(rows.exact[i])]
    return set(cached[-k:])


@pytest.mark.parametrize("selector", ["kv-deviation", "chunk-kv", "random"])
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.4])
def test_rows_near_the_question_come_first_within_the_budget_of_each_check_layer(
    tokenizer, selector, ratio
):
    """The last k cached rows before the question are kept at every check layer while the
    budget holds them; a smaller budget keeps the ones closest to the question, never more."""
    k = 7
    engine = engine_for(
        tiny_model("llama", num_hidden_layers=4),
        tokenizer,
        selector=selector,
        near_question_tokens=k,
        chunk_start_tokens=0,
        check_layers=(0, 2),
        check_scales=(2.0, 1.0),
    )
    engine.precompute(CHUNKS)
    trace, rows = _selection(engine, ratio)
    near = _near_question(rows, k)
    assert len(near) == k and max(near) < rows.question_start
    forced = set(rows.forced_list)
    for layer, scale in ((0, 2.0), (2, 1.0)):
        kept = set(trace.selections[layer].tolist()) - forced
        budget = round(ratio * scale * rows.num_approx)
        assert len(kept) == budget
        if budget >= k:
            assert near <= kept
        else:
            assert kept == set(sorted(near)[k - budget :])


def test_the_rows_near_the_question_skip_the_separators_between_chunks(tokenizer):
    """A window longer than the last chunk goes on into the chunk before it, counting cached
    rows only (a separator is recomputed anyway and is not one of the k)."""
    engine = engine_for(
        tiny_model("llama", num_hidden_layers=3),
        tokenizer,
        chunk_start_tokens=0,
        check_layers=(1,),
        check_scales=None,
    )
    engine.precompute(CHUNKS)
    _, rows = _selection(engine, 0.0)
    last_chunk = int((rows.offsets[: rows.question_start] == 0).nonzero().max())
    k = rows.question_start - last_chunk + 3  # the last chunk and 3 rows before it
    near = _near_question(rows, k)
    assert len(near) == k and min(near) < last_chunk - 1  # past the separator
    trace, _ = _selection(engine.with_config(near_question_tokens=k), k / rows.num_approx)
    assert set(trace.selections[1].tolist()) - set(rows.forced_list) == near


def test_chunk_starts_go_before_rows_near_the_question(tokenizer):
    engine = engine_for(
        tiny_model("llama", num_hidden_layers=3),
        tokenizer,
        near_question_tokens=5,
        chunk_start_tokens=2,
        check_layers=(1,),
        check_scales=None,
    )
    engine.precompute(CHUNKS)
    _, rows = _selection(engine, 0.0)
    forced = set(rows.forced_list)
    starts = {i for i in rows.candidates.tolist() if int(rows.offsets[i]) < 2} - forced
    near = _near_question(rows, 5)
    # a budget of 0: the starts alone, on top of it
    trace, _ = _selection(engine, 0.0)
    assert set(trace.selections[1].tolist()) - forced == starts
    # a budget of the starts and 3 more rows: the starts, then the 3 rows nearest the question
    trace, _ = _selection(engine, (len(starts) + 3) / rows.num_approx)
    assert set(trace.selections[1].tolist()) - forced == starts | set(sorted(near)[2:])
    # a budget larger than both: both, then rows by deviation
    trace, _ = _selection(engine, 0.5)
    kept = set(trace.selections[1].tolist()) - forced
    assert starts | near <= kept and len(kept) == round(0.5 * rows.num_approx)


@pytest.mark.parametrize("family", FAMILIES)
def test_near_question_at_ratio_one_equals_hf_full_prefill(tokenizer, family):
    engine = engine_for(tiny_model(family), tokenizer, ratio=1.0, near_question_tokens=16)
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    out = engine.prefill(prompt, "blend")
    assert out.stats.recomputed_fraction == 1.0
    assert_matches_hf(out, hf_forward(engine.model, prompt.ids), range(3), atol=1e-4)


@pytest.mark.parametrize("bad", [-1, 2.5, True])
def test_bad_near_question_tokens_is_one_clear_error(bad):
    with pytest.raises(RagblendError, match="near_question_tokens"):
        BlendConfig(near_question_tokens=bad)
