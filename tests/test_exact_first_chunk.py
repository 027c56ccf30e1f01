"""``exact_first_chunk``: a chunk also cached as a prompt's first chunk sees it (after the
prompt head), taken exactly by prompts that start with it (issue 54)."""

from __future__ import annotations

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import assert_matches_hf, engine_for, flip_last_layer_byte, fuse_prompt, hf_forward

from ragblend.errors import RagblendError
from ragblend.fusion.trace import SelectionTrace
from ragblend.store.disk import DiskStore


@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_of_a_one_chunk_prompt_equals_hf_full_prefill(tokenizer, family):
    """Head and first chunk both exact: reuse computes the question alone and still equals
    HF's full prefill; without the option the chunk's cache (after the canonical head) does
    not."""
    # float32 entries: a model's own dtype is lossless (``auto`` stores int8 on float32)
    engine = engine_for(tiny_model(family), tokenizer, exact_first_chunk=True, kv_dtype="float32")
    engine.precompute(CHUNKS[:1])
    prompt = engine.tokenize(QUESTION, CHUNKS[:1])
    ref = hf_forward(engine.model, prompt.ids)
    out = engine.prefill(prompt, "reuse")
    assert_matches_hf(out, ref, range(2), atol=1e-4)
    plain = engine.with_config(exact_first_chunk=False).prefill(prompt, "reuse")
    assert (plain.logits - ref.logits[0, -1].float()).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_blend_at_ratio_one_equals_hf_full_prefill(tokenizer, family):
    engine = engine_for(tiny_model(family), tokenizer, exact_first_chunk=True, ratio=1.0)
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    out = engine.prefill(prompt, "blend")
    assert_matches_hf(out, hf_forward(engine.model, prompt.ids), range(3), atol=1e-4)


def _fused(engine, prompt) -> tuple[list, SelectionTrace, object]:
    trace = SelectionTrace()
    result, segments = fuse_prompt(engine, prompt, 0.5, trace)
    assert all(s.kv is not None for s in segments if s.kind == "chunk")  # no chunk missed
    return segments, trace, result


def test_the_exact_first_chunk_is_never_recomputed_and_leaves_the_budget(tokenizer):
    """Its rows are not candidates: none is selected, and the same ratio recomputes fewer
    rows (the budget is a share of the approximate rows)."""
    engine = engine_for(
        tiny_model("llama", num_hidden_layers=3),
        tokenizer,
        exact_first_chunk=True,
        kv_dtype="float32",  # the model's dtype: the first chunk's entry is exact
        check_layers=(1,),
        check_scales=None,
        chunk_start_tokens=0,
        near_question_tokens=0,
    )
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    segments, trace, on = _fused(engine, prompt)
    start = len(segments[0])
    first = set(range(start, start + len(segments[1])))
    assert segments[1].exact
    assert not first & set(trace.selections[1].tolist())
    _, _, off = _fused(engine.with_config(exact_first_chunk=False), prompt)
    assert on.candidates == off.candidates - len(segments[1])
    assert sum(on.rows_per_layer) < sum(off.rows_per_layer)


def test_a_lossy_kv_dtype_takes_the_first_chunk_entry_as_a_cache_to_blend(tokenizer):
    """int8 storage: the entry is used, but its rows stay candidates (not exact)."""
    engine = engine_for(
        tiny_model("llama", num_hidden_layers=3),
        tokenizer,
        exact_first_chunk=True,
        kv_dtype="int8",
        check_layers=(1,),
        check_scales=None,
    )
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    segments, _ = engine.chunks.lookup(prompt)
    first = segments[1]
    head_key = engine.chunks.key(context_ids=prompt.head, chunk_ids=prompt.chunks[0])
    assert first.kv is not None and not first.exact
    assert torch.equal(first.kv.tensors["k"], engine.store.get(head_key).tensors["k"])


def test_precompute_stores_one_more_entry_per_chunk(tokenizer):
    off = engine_for(tiny_model("llama", num_hidden_layers=2), tokenizer, exact_first_chunk=False)
    off.precompute(CHUNKS)
    on = engine_for(tiny_model("llama", num_hidden_layers=2), tokenizer, exact_first_chunk=True)
    on.precompute(CHUNKS)
    head = on.prompt_head()
    for chunk in on.tokenize(QUESTION, CHUNKS).chunks:
        assert on.chunks.key(context_ids=head, chunk_ids=chunk) in on.store
        assert off.chunks.key(context_ids=head, chunk_ids=chunk) not in off.store
    # a second precompute finds both entries and computes nothing
    assert on.precompute(CHUNKS) == 0


def test_prefix_context_stores_the_chunk_once(tokenizer):
    """With ``precompute_context="prefix"`` the chunk's own entry is the first chunk's."""
    engine = engine_for(
        tiny_model("llama", num_hidden_layers=2),
        tokenizer,
        exact_first_chunk=True,
        precompute_context="prefix",
        kv_dtype="float32",  # the model's dtype: the entry is exact
    )
    assert engine.precompute(CHUNKS) == len(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    segments, _ = engine.chunks.lookup(prompt)
    assert segments[1].exact and not segments[3].exact


def test_a_chunk_without_its_first_chunk_entry_uses_its_own_entry(tokenizer):
    """Precomputed without the option: the first chunk is served from its one entry, as
    before, and is not a miss."""
    engine = engine_for(
        tiny_model("llama", num_hidden_layers=2), tokenizer, exact_first_chunk=False
    )
    engine.precompute(CHUNKS)
    view = engine.with_config(exact_first_chunk=True)
    segments, missing = view.chunks.lookup(view.tokenize(QUESTION, CHUNKS))
    assert missing == [] and segments[1].kv is not None and not segments[1].exact


def test_exact_first_chunk_must_be_a_bool(tokenizer):
    with pytest.raises(RagblendError, match="exact_first_chunk must be True or False"):
        engine_for(tiny_model("llama", num_hidden_layers=2), tokenizer, exact_first_chunk=1)


def _warmed_on_disk(tokenizer, tmp_path):
    """An engine (defaults) over a DiskStore holding every chunk, and the prompt of them."""
    store = DiskStore(tmp_path / "kv", 1 << 30, fsync=False)
    engine = engine_for(tiny_model("llama", num_hidden_layers=2), tokenizer)
    engine.store = store
    engine.precompute(CHUNKS)
    return engine, store, engine.tokenize(QUESTION, CHUNKS)


def test_a_corrupt_first_chunk_entry_is_dropped_and_the_chunk_served_from_its_own(
    tokenizer, tmp_path
):
    engine, store, prompt = _warmed_on_disk(tokenizer, tmp_path)
    want = engine.with_config(exact_first_chunk=False).prefill(prompt, "blend")
    first = engine.chunks.key(context_ids=prompt.head, chunk_ids=prompt.chunks[0])
    flip_last_layer_byte(store, first)
    got = engine.prefill(prompt, "blend")
    assert first not in store
    assert got.stats.chunk_hits == len(CHUNKS)
    assert torch.equal(got.logits, want.logits)


def test_every_entry_of_a_prompt_corrupt_is_recomputed_not_a_crash(tokenizer, tmp_path):
    """The head, the first chunk's exact entry and every chunk's own: each dropped once."""
    engine, store, prompt = _warmed_on_disk(tokenizer, tmp_path)
    keys = list(store.keys())
    head = engine.chunks.prefix_key(prompt.head)
    assert len(keys) == 2 * len(CHUNKS) + 2 and head in keys
    canonical = engine.chunks.prefix_key(engine.chunks.context_ids(prompt.head))
    for key in keys:
        if key != canonical:  # the precompute head: only read when a chunk is computed
            flip_last_layer_byte(store, key)
    got = engine.prefill(prompt, "blend")
    assert got.stats.chunk_misses == len(CHUNKS)
    torch.testing.assert_close(got.logits, engine.prefill(prompt, "full").logits, atol=1e-4, rtol=0)
