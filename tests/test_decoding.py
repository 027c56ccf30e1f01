"""The shared decode loop's bookkeeping: incremental text, stop strings, EOS, max_tokens.

Work is measured as counts (ids passed to ``tokenizer.decode``, characters held for stop
strings), never as time.
"""

from __future__ import annotations

import random

import pytest
from helpers import tiny_model

from ragblend import BlendConfig, BlendEngine
from ragblend.decode.detokenize import Detokenizer
from ragblend.decode.loop import DecodeState, StopStrings, decode_steps
from ragblend.decode.sampling import SamplingParams

TEXTS = [
    "Thomas Nabbes — an English dramatist, née 1605.",
    "日本語のテキスト 😀👍🏽 Ünïcödé «quotes» isn't  two  spaces\n\nand a new paragraph",
    "Привет, мир! Ελληνικά. עברית. 🇫🇷🇩🇪 ⅓ ½ ∑∫ — ok",
]


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def feed(tokenizer, ids, max_tokens=10_000, eos=(), **params) -> tuple[DecodeState, list[str]]:
    state = DecodeState(SamplingParams(**params), set(eos), max_tokens, tokenizer)
    deltas = []
    for token in ids:
        deltas.append(state.add(token))
        if state.done:
            break
    deltas.append(state.finish("length"))
    return state, deltas


def detokenized(tokenizer, ids) -> str:
    d = Detokenizer(tokenizer)
    return "".join(d.add(t) for t in ids) + d.flush()


def test_deltas_join_to_the_decoded_text(tokenizer):
    for text in TEXTS:
        state, deltas = feed(tokenizer, ids_of(tokenizer, text))
        assert "".join(deltas) == state.text == text
        assert state.finish_reason == "length"


def test_incremental_text_equals_decoding_every_id_at_once(tokenizer, dev_cases):
    """Real text (MuSiQue passages, non-ASCII samples) and random ids over the whole vocabulary,
    with special tokens and split multi-byte characters mixed in."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    real = [ids_of(tokenizer, t) for t in TEXTS]
    real += [ids_of(tokenizer, p["text"]) for c in dev_cases for p in c["ctxs"]]
    sequences = list(real)
    for _ in range(200):
        sequences.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 80))])
        mixed = list(rng.choice(real)[:100])
        for _ in range(8):
            mixed.insert(rng.randrange(len(mixed) + 1), rng.choice([0, 1, 2, rng.randrange(vocab)]))
        sequences.append(mixed)
    for ids in sequences:
        assert detokenized(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_an_incomplete_character_is_held_until_its_last_byte(tokenizer):
    ids = ids_of(tokenizer, "a 😀")
    d = Detokenizer(tokenizer)
    shown = [d.add(t) for t in ids]
    assert len(ids) > 2 and all("\ufffd" not in s for s in shown)
    assert "".join(shown) == "a 😀" and shown[-1].endswith("😀")


def test_a_stop_string_ends_the_text_before_it_even_across_tokens(tokenizer):
    stop = "\n\nQuestion"
    ids = ids_of(tokenizer, "Answer: Oxford\n\nQuestion: next")
    assert not any(stop in tokenizer.decode([t]) for t in ids)  # it spans several tokens
    state, deltas = feed(tokenizer, ids, stop=[stop])
    assert state.finish_reason == "stop" and state.text == "Answer: Oxford"
    assert "".join(deltas) == "Answer: Oxford"  # never shown, then taken back
    assert len(state.token_ids) < len(ids)  # decoding ended at the stop


def test_text_that_only_starts_like_a_stop_is_released(tokenizer):
    state, deltas = feed(tokenizer, ids_of(tokenizer, "a END-ish ending"), stop=["ENDX"])
    assert state.finish_reason == "length" and "".join(deltas) == "a END-ish ending"


def test_the_earliest_of_several_stop_strings_wins():
    stops = StopStrings(["cd", "b"])
    assert stops.add("a") == ""  # "a" could not start either, but one char is held back
    assert stops.add("bcd") == "a" and stops.stopped


def test_eos_ends_the_answer_unless_ignore_eos(tokenizer):
    ids = ids_of(tokenizer, "one two three four")
    eos = ids[2]
    state, _ = feed(tokenizer, ids, eos=[eos])
    assert state.finish_reason == "stop" and state.token_ids == ids[:2]
    assert state.text == tokenizer.decode(ids[:2])
    state, _ = feed(tokenizer, ids, eos=[eos], ignore_eos=True)
    assert state.finish_reason == "length" and state.token_ids == ids


def test_max_tokens_ends_the_answer_with_length(tokenizer):
    ids = ids_of(tokenizer, "one two three four five")
    state = DecodeState(SamplingParams(), set(), 3, tokenizer)
    deltas = [state.add(t) for t in ids[:3]]
    assert state.done and state.finish_reason == "length" and state.token_ids == ids[:3]
    assert "".join(deltas) == tokenizer.decode(ids[:3])
    with pytest.raises(RuntimeError):
        state.add(ids[3])
    assert DecodeState(SamplingParams(), set(), 0, tokenizer).finish_reason == "length"


def test_stop_is_a_string_or_strings():
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", ""]).stop == ("a",)


def test_work_per_token_is_flat_over_a_long_answer(tokenizer, dev_cases):
    """2,000+ tokens of real text: ids decoded and characters searched for stop strings per
    token are the same at the end as at the start (re-decoding every id grew with length)."""
    text = " ".join(p["text"] for c in dev_cases for p in c["ctxs"])
    ids = (ids_of(tokenizer, text + " 日本語 😀 ") * 3)[:2400]
    assert len(ids) == 2400
    calls: list[int] = []
    counting = CountingTokenizer(tokenizer, calls)
    state = DecodeState(SamplingParams(stop=["NEVER-HERE"]), set(), len(ids), counting)
    work, held = [], []
    for token in ids:
        before = sum(calls)
        state.add(token)
        work.append(sum(calls) - before)
        held.append(len(state.stops.held))
    assert state.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(work[-500:]) <= max(work[:500]) <= 16
    assert sum(work[-500:]) <= 1.2 * sum(work[:500])
    assert max(held) <= 9 + max(len(tokenizer.decode([t])) for t in ids)


class CountingTokenizer:
    """The tokenizer, counting the ids each ``decode`` call is given."""

    def __init__(self, tokenizer, calls: list[int]) -> None:
        self._tokenizer = tokenizer
        self.calls = calls
        self.added_tokens_decoder = tokenizer.added_tokens_decoder
        self.all_special_ids = tokenizer.all_special_ids

    def decode(self, ids, **kwargs) -> str:
        self.calls.append(len(ids))
        return self._tokenizer.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def tiny_engine(tokenizer):
    return BlendEngine(tiny_model("llama"), tokenizer, BlendConfig())


def test_a_2000_token_generation_does_flat_work_per_token(tiny_engine, tokenizer):
    """The loop generate/stream run (``decode_steps`` over a ``DecodeState``), 2,000 tokens
    with ``ignore_eos``: the ids detokenised per step do not grow with the answer."""
    engine = tiny_engine
    prompt = engine.chat_ids([{"role": "user", "content": "Tell me a long story."}])
    engine.prepare_decode()
    pre = engine.full_prefill(prompt)
    calls: list[int] = []
    params = SamplingParams(temperature=1.0, seed=3, ignore_eos=True, stop=["\x00never"])
    state = DecodeState(params, engine.eos_ids, 2000, CountingTokenizer(tokenizer, calls), prompt)
    work = []
    for _ in decode_steps(state, pre.logits, engine.decoder(pre, 2000).step):
        work.append(sum(calls))
        calls.clear()
    assert len(work) == 2000 and state.finish_reason == "length"
    assert state.text == tokenizer.decode(state.token_ids, skip_special_tokens=True)
    assert max(work[-500:]) <= 16 and sum(work[-500:]) <= 1.5 * sum(work[:500]) + 500


def test_streamed_text_of_sampled_generations_equals_the_decoded_ids(tiny_engine, tokenizer):
    prompt = tiny_engine.chat_ids([{"role": "user", "content": "Écris un poème 😀"}])
    for seed in range(6):
        stream = tiny_engine.stream_prompt(prompt, max_new_tokens=60, temperature=1.5, seed=seed)
        streamed = "".join(stream)
        result = stream.result
        assert result is not None and len(result.token_ids) == result.stats.completion_tokens
        assert streamed == result.text
        assert result.text == tokenizer.decode(result.token_ids, skip_special_tokens=True)
