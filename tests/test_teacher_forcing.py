"""Teacher forcing is the decode path fed the answer: a greedy answer is its own argmax.

The quality benchmarks score a prefill by teacher-forcing full prefill's greedy answer after
it; when the forced logits came from one batched forward over the answer, int8 decode
activations rounded some inputs to other int8 steps than the token-by-token decode did, and full
prefill disagreed with its own answer on a fifth of the MuSiQue questions (AVX2, embedded model).
"""

from __future__ import annotations

import pytest
import torch
from conftest import CHUNKS, QUESTION

from ragblend.decode.generation import SamplingParams, decode_tokens, teacher_forced_logits

NUMERICS = [
    {"decode_activations": "float", "kv_cache_dtype": "auto"},
    {"decode_activations": "int8", "kv_cache_dtype": "auto"},
    {"decode_activations": "float", "kv_cache_dtype": "int8"},
]


def _answer(engine, max_new_tokens: int = 16):
    pre = engine.prefill(engine.tokenize(QUESTION, CHUNKS), "full")
    return pre, engine.greedy_answer(pre, max_new_tokens)


@pytest.mark.parametrize("numerics", NUMERICS, ids=lambda n: "/".join(n.values()))
def test_greedy_answer_is_its_own_teacher_forced_argmax(embedded_engine, numerics):
    view = embedded_engine.with_config(**numerics)
    pre, ids = _answer(view)
    assert len(ids) > 3
    forced = view.teacher_forced_logits(pre, ids)
    assert forced.shape == (len(ids), view.model.config.vocab_size)
    assert forced.argmax(-1).tolist() == ids
    assert torch.equal(forced[0], pre.logits.reshape(-1).float())


def test_teacher_forcing_leaves_the_prefill_as_it_was(embedded_engine):
    pre, ids = _answer(embedded_engine)
    first = embedded_engine.teacher_forced_logits(pre, ids)
    again = embedded_engine.teacher_forced_logits(pre, ids)
    assert torch.equal(first, again)
    assert embedded_engine.greedy_answer(pre, 16) == ids


def test_hf_decoder_path_is_its_own_teacher_forced_argmax(embedded_engine):
    """Without a layer-wise adapter both go through HF's forward (HFDecoder)."""
    engine = embedded_engine
    pre = engine.prefill(engine.tokenize(QUESTION, CHUNKS), "full")
    ids = list(decode_tokens(engine.model, pre, SamplingParams(), 12, engine.eos_ids))
    forced = teacher_forced_logits(engine.model, pre, ids)
    assert forced.argmax(-1).tolist() == ids


def test_one_token_answer_is_the_prefill_row(embedded_engine):
    pre, ids = _answer(embedded_engine)
    forced = embedded_engine.teacher_forced_logits(pre, ids[:1])
    assert forced.shape[0] == 1
    assert torch.equal(forced[0], pre.logits.reshape(-1).float())
