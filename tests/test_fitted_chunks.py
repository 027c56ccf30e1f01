"""Chunks whose cache was precomputed after the chunk before them in the prompt (issue 54):
the entry records its neighbours, the lookup finds the fit, ``fitted_chunk_weight`` ranks
their rows after the others."""

from __future__ import annotations

import pytest
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import assert_matches_hf, engine_for, fuse_prompt, hf_forward

from ragblend import BlendConfig, BlendEngine, SelectionPolicy
from ragblend.bench.gpu_ops import count_prefill
from ragblend.bench.op_counter import DeviceTracker
from ragblend.errors import RagblendError
from ragblend.fusion.rows import prompt_rows
from ragblend.fusion.trace import SelectionTrace
from ragblend.store.disk import DiskStore
from ragblend.store.memory import MemoryStore

# CHUNKS[1] and CHUNKS[2] are precomputed after CHUNKS[0]; CHUNKS[0] alone
NEIGHBOURS = {CHUNKS[0]: [], CHUNKS[1]: [CHUNKS[0]], CHUNKS[2]: [CHUNKS[0]]}
# fitted chunks' rows after every other row
FITTED_LAST = SelectionPolicy(fitted_chunk_weight=0.0)


def _engine(tokenizer, model=None, **config) -> BlendEngine:
    options = {"precompute_context": "neighbours", "exact_first_chunk": False, **config}
    return engine_for(model or tiny_model("llama", num_hidden_layers=3), tokenizer, **options)


def _fits(engine: BlendEngine, order: list[int]) -> list[bool]:
    segments, _ = engine.chunks.lookup(engine.tokenize(QUESTION, [CHUNKS[i] for i in order]))
    return [s.fits for s in segments if s.kind == "chunk"]


def test_a_chunk_fits_where_its_prompt_predecessor_was_one_of_its_neighbours(tokenizer):
    engine = _engine(tokenizer)
    engine.precompute(CHUNKS, neighbours=NEIGHBOURS)
    assert _fits(engine, [0, 1, 2]) == [False, True, False]
    assert _fits(engine, [0, 2, 1]) == [False, True, False]
    assert _fits(engine, [1, 0, 2]) == [False, False, True]
    assert _fits(engine, [2, 1, 0]) == [False, False, False]


def test_chunks_precomputed_alone_never_fit(tokenizer):
    engine = _engine(tokenizer, precompute_context="canonical")
    engine.precompute(CHUNKS)
    assert _fits(engine, [0, 1, 2]) == [False, False, False]


def test_the_fit_survives_the_disk_tier(tokenizer, tmp_path):
    model = tiny_model("llama", num_hidden_layers=3)
    config = BlendConfig(precompute_context="neighbours", exact_first_chunk=False)
    writer = BlendEngine(model, tokenizer, config, store=DiskStore(tmp_path, fsync=False))
    writer.precompute(CHUNKS, neighbours=NEIGHBOURS)
    reader = BlendEngine(model, tokenizer, config, store=DiskStore(tmp_path, fsync=False))
    assert _fits(reader, [0, 1, 2]) == [False, True, False]


def _kept(engine: BlendEngine, ratio: float) -> tuple[set[int], object, SelectionTrace]:
    """Rows the check layer keeps beyond the forced ones, the prompt's rows, the trace."""
    trace = SelectionTrace()
    _, segments = fuse_prompt(engine, engine.tokenize(QUESTION, CHUNKS), ratio, trace)
    rows = prompt_rows(segments, "cpu")
    return set(trace.selections[1].tolist()) - set(rows.forced_list), rows, trace


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_fitted_rows_are_ranked_by_their_lowered_score_and_lose_their_chunk_starts(
    tokenizer, weight
):
    """The check layer keeps the other chunks' starts, then the best rows by score with the
    fitted chunk's scores × the weight (at 0: after every other row, in score order)."""
    engine = _engine(
        tokenizer,
        check_layers=(1,),
        check_scales=None,
        chunk_start_tokens=2,
        near_question_tokens=0,
        selection=SelectionPolicy(fitted_chunk_weight=weight),
    )
    engine.precompute(CHUNKS, neighbours=NEIGHBOURS)
    _, rows, trace = _kept(engine, 0.0)
    forced = set(rows.forced_list)
    candidates = rows.candidates.tolist()
    free = [j for j, i in enumerate(candidates) if i not in forced]
    fitted = {i for i in candidates if rows.fitted_list[i]} - forced
    assert fitted  # CHUNKS[1] fits after CHUNKS[0]
    starts = {i for i in candidates if rows.offset_list[i] < 2} - forced - fitted
    others = set(candidates) - forced - fitted
    for extra in (len(others) - len(starts) - 1, len(others) - len(starts) + 3):
        kept, _, trace = _kept(engine, (len(starts) + extra) / rows.num_approx)
        scores = {candidates[j]: float(trace.scores[1][j]) for j in free}

        def rank(i: int, scores: dict[int, float] = scores) -> tuple[int, float]:
            if i not in fitted:
                return (0, -scores[i])
            return (0, -scores[i] * weight) if weight else (1, -scores[i])

        ranked = sorted(set(scores) - starts, key=rank)
        assert rank(ranked[extra - 1]) != rank(ranked[extra])  # no tie decides the set
        assert starts <= kept
        assert kept == starts | set(ranked[:extra])


@pytest.mark.parametrize("family", FAMILIES)
def test_fitted_weight_zero_at_ratio_one_equals_hf_full_prefill(tokenizer, family):
    engine = _engine(tokenizer, tiny_model(family), ratio=1.0, selection=FITTED_LAST)
    engine.precompute(CHUNKS, neighbours=NEIGHBOURS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    out = engine.prefill(prompt, "blend")
    assert out.stats.recomputed_fraction == 1.0
    assert_matches_hf(out, hf_forward(engine.model, prompt.ids), range(3), atol=1e-4)


def test_fitted_weight_changes_nothing_without_a_fitted_chunk(tokenizer):
    engine = _engine(
        tokenizer, precompute_context="canonical", check_layers=(1,), check_scales=None
    )
    engine.precompute(CHUNKS)
    plain, _, _ = _kept(engine, 0.3)
    lowered, _, _ = _kept(engine.with_config(selection=FITTED_LAST), 0.3)
    assert plain == lowered


@pytest.mark.parametrize("bad", [-0.1, 1.5, True, "0"])
def test_bad_fitted_chunk_weight_is_one_clear_error(bad):
    with pytest.raises(RagblendError, match="fitted_chunk_weight"):
        BlendConfig(selection=SelectionPolicy(fitted_chunk_weight=bad))


def test_lowering_the_fitted_rows_reads_nothing_back_from_the_device(tokenizer):
    """On the path a GPU runs, the fitted rows' mask is uploaded once and lowers the scores
    on the device: no host sync, as without it."""
    store = MemoryStore(1 << 30)
    config = BlendConfig(
        precompute_context="neighbours", exact_first_chunk=False, row_attention="masked"
    )
    model = tiny_model("llama", num_hidden_layers=4)
    engine = BlendEngine(model, tokenizer, config, store=store)
    engine.precompute(CHUNKS, neighbours=NEIGHBOURS)
    store.prefetch_depth = 0  # layers loaded on this thread, where the counter sees them
    prompt = engine.tokenize(QUESTION, CHUNKS)
    tracker = DeviceTracker.for_model(model)
    plain = count_prefill(engine, prompt, "blend", tracker=tracker)
    lowered = count_prefill(
        engine.with_config(selection=FITTED_LAST), prompt, "blend", tracker=tracker
    )
    assert plain.syncs_per_prefill == lowered.syncs_per_prefill == 0
    assert lowered.kernels_per_check_layer > plain.kernels_per_check_layer  # it did run
