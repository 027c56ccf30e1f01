"""Ratio 1.0 reproduces HF's full prefill for every family; prefix equals full; reuse is reuse."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import assert_matches_hf, engine_for, hf_forward, layer_kv

ATOL = 1e-4

# Sliding windows shorter than the prompt exercise the windowed mask (Mistral, Qwen2; the tiny
# Gemma 3 always has one).
WINDOWED = {
    "mistral": {"sliding_window": 24},
    "qwen2": {
        "use_sliding_window": True,
        "sliding_window": 24,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    },
}


def _model(family, windowed=False):
    return tiny_model(family, **(WINDOWED.get(family, {}) if windowed else {}))


@pytest.fixture(
    params=[(f, False) for f in FAMILIES] + [(f, True) for f in WINDOWED],
    ids=lambda p: p[0] + ("-window" if p[1] else ""),
)
def family_engine(request, tokenizer):
    family, windowed = request.param
    model = _model(family, windowed)
    engine = engine_for(model, tokenizer, ratio=1.0)
    engine.precompute(CHUNKS)
    return engine


def test_blend_at_ratio_one_matches_hf_full_prefill_logits_and_every_layer_kv(family_engine):
    engine = family_engine
    prompt = engine.tokenize(QUESTION, CHUNKS)
    ref = hf_forward(engine.model, prompt.ids)
    out = engine.prefill(prompt, "blend")
    assert out.stats.chunk_hits == len(CHUNKS)
    assert out.stats.recomputed_fraction == 1.0
    assert_matches_hf(out, ref, range(engine.layers.num_layers), atol=ATOL)


def test_full_mode_is_hf_prefill_and_prefix_mode_equals_it(family_engine):
    engine = family_engine
    prompt = engine.tokenize(QUESTION, CHUNKS)
    ref = hf_forward(engine.model, prompt.ids)
    for mode in ("full", "prefix"):
        out = engine.prefill(prompt, mode)
        assert_matches_hf(out, ref, range(engine.layers.num_layers), atol=ATOL)


def test_greedy_generation_after_ratio_one_blend_equals_hf_generate(family_engine):
    engine = family_engine
    prompt = engine.tokenize(QUESTION, CHUNKS)
    result = engine.generate(QUESTION, CHUNKS, mode="blend", max_new_tokens=12)
    with torch.inference_mode():
        ref = engine.model.generate(
            torch.tensor([prompt.ids]),
            max_new_tokens=12,
            do_sample=False,
            eos_token_id=list(engine.eos_ids),
            pad_token_id=0,
        )
    ref_ids = [t for t in ref[0, len(prompt.ids) :].tolist() if t not in engine.eos_ids]
    assert result.token_ids == ref_ids[: len(result.token_ids)]
    assert len(result.token_ids) == len(ref_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_equals_stored_chunk_caches_with_only_positions_changed(family, tokenizer):
    engine = engine_for(_model(family), tokenizer)
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    out = engine.prefill(prompt, "reuse")
    lay = engine.layers
    context = engine.chunks.context_ids(prompt.head)
    start = len(prompt.head)
    for i, chunk in enumerate(prompt.chunks):
        if i:
            start += len(prompt.separator)
        # the first chunk is served from its exact entry, after the prompt head
        after = prompt.head if i == 0 else context
        stored = engine.store.get(engine.chunk_key(context_ids=after, chunk_ids=chunk))
        positions = torch.arange(start, start + len(chunk))
        for layer in range(lay.num_layers):
            k_pre, v = stored.layer(layer)
            cos, sin = lay.rope(positions, k_pre.unsqueeze(0), layer)
            k_expected = lay.rotate(k_pre.unsqueeze(0), cos, sin)
            k, v_out = layer_kv(out.cache, layer)
            # a sliding-window layer's cache holds only the prompt's last positions
            first = len(prompt) - k.shape[2]
            a, b = max(start, first), start + len(chunk)
            if a >= b:
                continue
            torch.testing.assert_close(
                k[:, :, a - first : b - first], k_expected[:, :, a - start :], atol=1e-6, rtol=0
            )
            assert torch.equal(v_out[0, :, a - first : b - first], v[:, a - start :])
        start += len(chunk)


@pytest.mark.slow
def test_embedded_model_blend_at_ratio_one_matches_full_prefill(embedded_engine):
    engine = embedded_engine.with_config(ratio=1.0)
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    ref = hf_forward(engine.model, prompt.ids)
    out = engine.prefill(prompt, "blend")
    assert_matches_hf(out, ref, (0, 14, engine.layers.num_layers - 1), atol=2e-4)
    assert (
        engine.generate(QUESTION, CHUNKS, max_new_tokens=8).text
        == engine.generate(QUESTION, CHUNKS, mode="full", max_new_tokens=8).text
    )


# the tiny Gemma 3's window is shorter than the prompt: no static cache (its own test below)
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma3"])
def test_decoding_into_the_static_cache_equals_hf_generate_and_leaves_the_prefill_alone(
    family, tokenizer
):
    from transformers import StaticCache

    from ragblend.decode.generation import decode_cache

    engine = engine_for(_model(family), tokenizer)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    pre = engine.prefill(prompt, "full")
    assert isinstance(decode_cache(engine.model, pre.cache, len(prompt) + 4), StaticCache)
    before = [layer_kv(pre.cache, i)[0].clone() for i in range(engine.layers.num_layers)]
    ids = engine.greedy_answer(pre, 24)
    with torch.inference_mode():
        ref = engine.model.generate(
            torch.tensor([prompt.ids]),
            max_new_tokens=24,
            do_sample=False,
            eos_token_id=list(engine.eos_ids),
            pad_token_id=0,
        )
    assert ids == [t for t in ref[0, len(prompt.ids) :].tolist() if t not in engine.eos_ids]
    for i, k in enumerate(before):
        assert torch.equal(layer_kv(pre.cache, i)[0], k)
    assert engine.greedy_answer(pre, 24) == ids  # the prefill can be decoded again


@pytest.mark.parametrize("family", FAMILIES)
def test_layerwise_decoding_equals_hf_forward_decoding_token_by_token(family, tokenizer):
    from ragblend.decode.decoder import LayerDecoder
    from ragblend.decode.generation import SamplingParams, decode_tokens

    engine = engine_for(_model(family), tokenizer)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    for mode in ("full", "blend"):
        engine.precompute(CHUNKS)
        pre = engine.prefill(prompt, mode)
        lean = LayerDecoder.for_cache(engine.layers, pre.cache, len(prompt), len(prompt) + 8)
        assert lean is not None
        hf = engine.model
        greedy, eos = SamplingParams(), set()
        ids = list(decode_tokens(hf, pre, greedy, 8, eos, engine.layers))
        assert ids == list(decode_tokens(hf, pre, greedy, 8, eos, layers=None))
        # the logits along the way match HF's forward over the same cache (fp32 tolerance)
        with torch.inference_mode():
            ref = (
                hf(
                    input_ids=torch.tensor([ids[:-1]]),
                    past_key_values=copy.deepcopy(pre.cache),
                    use_cache=True,
                )
                .logits[0]
                .float()
            )
        got = torch.stack([lean.step(t) for t in ids[:-1]])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", [*sorted(WINDOWED), "gemma3"])
def test_decoding_with_a_sliding_window_equals_hf_generate(family, tokenizer):
    from ragblend.decode.decoder import LayerDecoder

    engine = engine_for(_model(family, windowed=True), tokenizer)
    long_prompt = engine.tokenize(QUESTION, CHUNKS[:1]).ids  # longer than the window
    for ids in (long_prompt, long_prompt[:16]):  # the short one decodes past the window
        pre = engine.full_prefill(ids)
        # HF's sliding caches keep the window's last tokens: enough for the lean decoder
        lean = LayerDecoder.for_cache(engine.layers, pre.cache, len(ids), len(ids) + 20)
        assert lean is not None
        with torch.inference_mode():
            ref = engine.model.generate(
                torch.tensor([ids]),
                max_new_tokens=20,
                do_sample=False,
                eos_token_id=list(engine.eos_ids),
                pad_token_id=0,
            )
        expected = [t for t in ref[0, len(ids) :].tolist() if t not in engine.eos_ids]
        assert engine.greedy_answer(pre, 20) == expected


def test_layerwise_decoding_declines_a_cache_that_does_not_hold_the_whole_prompt(tokenizer):
    from ragblend.decode.decoder import LayerDecoder

    engine = engine_for(_model(FAMILIES[0]), tokenizer)
    pre = engine.prefill(engine.tokenize(QUESTION, CHUNKS), "full")
    n = len(pre.prompt_ids)
    assert LayerDecoder.for_cache(engine.layers, pre.cache, n - 1, n + 4) is None
    assert LayerDecoder.for_cache(engine.layers, object(), n, n + 4) is None
    too_long = engine.layers.context_window + 1
    assert LayerDecoder.for_cache(engine.layers, pre.cache, n, too_long) is None
