"""A request's text: incremental detokenisation and OpenAI stop sequences."""

from __future__ import annotations

from ragblend.serving.output import TextOutput


def feed(tokenizer, text: str, stop=()) -> tuple[TextOutput, list[str]]:
    out = TextOutput(tokenizer, stop)
    deltas = []
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        deltas.append(out.add(token))
        if out.stopped:
            break
    deltas.append(out.flush())
    return out, deltas


def test_deltas_join_to_the_decoded_text(tokenizer):
    out, deltas = feed(tokenizer, "Thomas Nabbes — an English dramatist, née 1605.")
    assert "".join(deltas) == out.text == "Thomas Nabbes — an English dramatist, née 1605."


def test_a_stop_sequence_ends_the_text_before_it_even_across_tokens(tokenizer):
    out, deltas = feed(tokenizer, "Answer: Oxford\n\nQuestion: next", stop=["\n\nQuestion"])
    assert out.stopped and out.text == "Answer: Oxford"
    assert "".join(deltas) == "Answer: Oxford"  # never shown, then taken back


def test_text_that_only_starts_like_a_stop_is_released(tokenizer):
    out, deltas = feed(tokenizer, "a END-ish ending", stop=["ENDX"])
    assert not out.stopped and "".join(deltas) == "a END-ish ending"
