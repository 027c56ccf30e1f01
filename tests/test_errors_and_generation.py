"""Bad input gets one clear error; generation options behave."""

from __future__ import annotations

import pytest
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


@pytest.mark.parametrize("bad", [{"ratio": 1.5}, {"mode": "fast"}, {"check_layers": ()},
                                 {"check_layers": (1, 2), "check_scales": (2.0,)},
                                 {"selector": "nope"},
                                 {"check_layers": (1, 2), "check_scales": (1.0, 2.0)}])
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
        engine.tokenize(QUESTION, CHUNKS))


def test_sampling_is_reproducible_with_a_seed_and_respects_max_new_tokens(engine):
    a = engine.generate(QUESTION, CHUNKS, temperature=1.0, top_p=0.9, seed=3, max_new_tokens=6)
    b = engine.generate(QUESTION, CHUNKS, temperature=1.0, top_p=0.9, seed=3, max_new_tokens=6)
    assert a.token_ids == b.token_ids and len(a.token_ids) <= 6
    assert a.stats.finish_reason in ("stop", "length")


def test_generation_stops_at_eos(embedded_engine):
    result = embedded_engine.generate_chat(
        [{"role": "user", "content": "Say hello."}], max_new_tokens=60)
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
