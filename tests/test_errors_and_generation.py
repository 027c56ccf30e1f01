"""Bad input gets one clear error; generation options behave."""

from __future__ import annotations

import pytest
import torch
from conftest import CHUNKS, QUESTION, tiny_model
from helpers import engine_for

from ragblend import BlendConfig, BlendEngine, RagblendError
from ragblend.models.loading import load_model


@pytest.fixture(scope="module")
def engine(tokenizer):
    e = engine_for(tiny_model("llama", max_position_embeddings=400), tokenizer)
    e.precompute(CHUNKS)
    return e


def test_empty_chunk_list_is_a_clear_error(engine):
    with pytest.raises(RagblendError, match="no chunks"):
        engine.generate(QUESTION, [])


def test_empty_chunk_is_a_clear_error(engine):
    with pytest.raises(RagblendError, match="chunk 1 is empty"):
        engine.generate(QUESTION, [CHUNKS[0], "   "])


def test_prompt_longer_than_context_window_is_a_clear_error(engine):
    with pytest.raises(RagblendError, match="context window of 400"):
        engine.generate(QUESTION, [CHUNKS[0] * 30])


def test_unsupported_architecture_is_a_clear_error(tmp_path, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2)).save_pretrained(tmp_path)
    with pytest.raises(RagblendError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_model(tmp_path)
    with pytest.raises(RagblendError, match="unsupported model architecture"):
        BlendEngine(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2)), tokenizer)


def test_not_a_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(RagblendError, match="not a local HF model directory"):
        load_model(tmp_path / "nope")


@pytest.mark.parametrize(
    "bad",
    [
        {"ratio": 1.5},
        {"mode": "fast"},
        {"check_layers": ()},
        {"check_layers": (1, 2), "check_scales": (2.0,)},
        {"selector": "nope"},
        {"check_layers": (1, 2), "check_scales": (1.0, 2.0)},
    ],
)
def test_bad_config_is_a_clear_error(bad, tokenizer):
    with pytest.raises(RagblendError):
        BlendEngine(tiny_model("llama"), tokenizer, BlendConfig(**bad))


def test_stream_yields_the_same_text_as_generate(engine):
    stream = engine.stream(QUESTION, CHUNKS, max_new_tokens=10)
    text = "".join(stream)
    result = engine.generate(QUESTION, CHUNKS, max_new_tokens=10)
    assert text == result.text == stream.result.text
    assert stream.result.stats.completion_tokens == len(result.token_ids) <= 10
    assert result.stats.ttft_ms > 0 and result.stats.prompt_tokens == len(
        engine.tokenize(QUESTION, CHUNKS)
    )


def test_sampling_is_reproducible_with_a_seed_and_respects_max_new_tokens(engine):
    a = engine.generate(QUESTION, CHUNKS, temperature=1.0, top_p=0.9, seed=3, max_new_tokens=6)
    b = engine.generate(QUESTION, CHUNKS, temperature=1.0, top_p=0.9, seed=3, max_new_tokens=6)
    assert a.token_ids == b.token_ids and len(a.token_ids) <= 6
    assert a.stats.finish_reason in ("stop", "length")


@pytest.mark.slow
def test_generation_stops_at_eos(embedded_engine):
    result = embedded_engine.generate_chat(
        [{"role": "user", "content": "Say hello."}], max_new_tokens=60
    )
    assert result.stats.finish_reason == "stop"
    assert not set(result.token_ids) & embedded_engine.eos_ids


def test_closing_a_stream_early_stops_decoding_and_keeps_the_partial_result(engine):
    stream = engine.stream(QUESTION, CHUNKS, max_new_tokens=10)
    first = next(iter(stream))
    stream.close()
    assert stream.result is not None
    assert stream.result.text.startswith(first)
    assert stream.result.stats.finish_reason == "stop"
    assert 1 <= stream.result.stats.completion_tokens < 10


# ---------------------------------------------------------------------- defects (issue 9)
@pytest.mark.parametrize("ratio", [1.5, -0.1, "half", True])
def test_a_per_call_ratio_outside_zero_to_one_is_a_clear_error(engine, ratio):
    with pytest.raises(RagblendError, match="ratio must be"):
        engine.generate(QUESTION, CHUNKS, ratio=ratio, max_new_tokens=1)
    with pytest.raises(RagblendError, match="ratio must be"):
        engine.prefill(engine.tokenize(QUESTION, CHUNKS), "blend", ratio=ratio)


def test_check_layers_beyond_the_models_depth_are_a_clear_error(tokenizer):
    with pytest.raises(RagblendError, match="has 3 layers"):
        BlendEngine(tiny_model("llama"), tokenizer, BlendConfig(check_layers=(1, 5)))


def test_the_default_check_layers_are_cut_to_a_shallow_models_depth(tokenizer):
    engine = BlendEngine(tiny_model("llama"), tokenizer)
    assert engine.config.check_layers == (1,) and engine.config.check_scales is None
    assert engine.with_config(ratio=0.3).config.check_layers == (1,)


def test_from_pretrained_applies_overrides_onto_the_given_config(monkeypatch, tokenizer):
    import ragblend.engine as engine_module

    monkeypatch.setattr(
        engine_module, "load_model", lambda *a, **k: (tiny_model("llama"), tokenizer)
    )
    engine = BlendEngine.from_pretrained(
        "embedded", config=BlendConfig(namespace="t1", check_layers=(0, 1)), ratio=0.3
    )
    assert engine.config.ratio == 0.3
    assert engine.config.namespace == "t1" and engine.config.check_layers == (0, 1)


def test_a_bad_mode_given_to_stream_raises_at_the_call(engine):
    with pytest.raises(RagblendError, match="unknown mode 'fast'"):
        engine.stream(QUESTION, CHUNKS, mode="fast")
    with pytest.raises(RagblendError, match="unknown mode"):
        engine.stream_prompt([1, 2, 3], mode="fast")


def test_selecting_part_of_the_cached_rows_without_a_selector_is_an_error(engine):
    from ragblend.fusion.fusor import fuse

    segments, _ = engine.chunks.lookup(engine.tokenize(QUESTION, CHUNKS))
    with pytest.raises(RagblendError, match="needs a token selector"):
        fuse(engine.layers, segments, engine.chunks.loader(segments), [(1, 0.3)], None)


def test_engine_chunk_keys_are_keyword_only_like_the_store_keys(engine):
    from ragblend.store.keys import chunk_key

    context, chunk = engine.prompt_head(), [5, 6, 7]
    assert engine.chunk_key(context_ids=context, chunk_ids=chunk) == chunk_key(
        fingerprint=engine.fingerprint,
        dtype=engine.layers.dtype,
        kv_dtype=engine.kv_dtype,
        namespace=None,
        context_ids=context,
        chunk_ids=chunk,
    )
    with pytest.raises(TypeError):
        engine.chunk_key(chunk, context)


def test_bad_sampling_parameters_are_a_clear_error(engine):
    with pytest.raises(RagblendError, match="top_p"):
        engine.generate(QUESTION, CHUNKS, top_p=0.0)
    with pytest.raises(RagblendError, match="temperature"):
        engine.stream(QUESTION, CHUNKS, temperature=-1.0)


# ---------------------------------------------------------------------- serialisation
def test_a_running_stream_holds_the_engine_until_closed_and_others_wait(engine):
    import threading

    stream = engine.stream(QUESTION, CHUNKS, max_new_tokens=8)
    assert not engine._lock.locked()  # nothing runs before the first step
    next(iter(stream))
    assert engine._lock.locked()
    order: list[str] = []
    other = threading.Thread(
        target=lambda: order.append(engine.generate(QUESTION, CHUNKS, max_new_tokens=2) and "b")
    )
    other.start()
    order.append("a")
    stream.close()
    other.join()
    assert order == ["a", "b"]
    assert not engine._lock.locked()


def test_an_exhausted_or_abandoned_stream_releases_the_engine(engine):
    import gc

    result = engine.stream(QUESTION, CHUNKS, max_new_tokens=3).collect()
    assert result.stats.completion_tokens <= 3 and not engine._lock.locked()
    stream = engine.stream(QUESTION, CHUNKS, max_new_tokens=8)
    next(iter(stream))
    del stream
    gc.collect()
    assert not engine._lock.locked()


def test_async_iteration_yields_the_same_text(engine):
    import asyncio

    async def collect():
        return "".join([d async for d in engine.stream(QUESTION, CHUNKS, max_new_tokens=6)])

    assert asyncio.run(collect()) == engine.generate(QUESTION, CHUNKS, max_new_tokens=6).text
    assert not engine._lock.locked()


# ---------------------------------------------------------------------- no silent fallback
@pytest.mark.parametrize("mode", ["blend", "reuse"])
def test_a_call_with_no_cached_chunk_runs_full_prefill_and_says_why(tokenizer, mode):
    engine = engine_for(tiny_model("llama"), tokenizer)  # nothing precomputed
    prompt = engine.tokenize(QUESTION, CHUNKS)
    out = engine.prefill(prompt, mode)
    assert out.stats.mode == "full" and out.fusion is None
    assert out.stats.fallback_reason == "cache_miss"
    assert "every chunk missed" in out.stats.fallback_message
    assert (out.stats.chunk_hits, out.stats.chunk_misses) == (0, len(CHUNKS))
    assert torch.equal(out.logits, engine.prefill(prompt, "full").logits)
    result = engine.generate(QUESTION, CHUNKS, mode=mode, max_new_tokens=2)
    assert result.stats.mode == "full" and result.stats.fallback_reason


def test_a_call_with_some_cached_chunks_blends_without_a_fallback_reason(engine):
    out = engine.prefill(engine.tokenize(QUESTION, CHUNKS), "blend")
    assert out.stats.mode == "blend" and out.stats.fallback_reason is None
