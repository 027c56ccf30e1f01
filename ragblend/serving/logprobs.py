"""Token logprobs in OpenAI's two shapes: chat's ``logprobs.content[]`` and the legacy
completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``.

Values are the log-softmax of the model's raw logits at each step (before penalties,
temperature, top-k and top-p: vLLM's default), see ``ragblend.decode.sampling.token_logprobs``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ragblend.decode import TokenLogprobs


def token_text(tokenizer, token: int) -> str:
    """One token as text (a partial UTF-8 character shows as U+FFFD, as in vLLM)."""
    return tokenizer.decode([token])


def chat_logprobs(tokenizer, items: Sequence[TokenLogprobs]) -> dict:
    """``choices[].logprobs`` of a chat completion (or of one stream chunk)."""

    def entry(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**entry(i.token, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in i.top]}
        for i in items
    ]
    return {"content": content}


def completion_logprobs(
    tokenizer, items: Sequence[TokenLogprobs], text_offset: int = 0
) -> tuple[dict, int]:
    """``choices[].logprobs`` of a legacy completion (or stream chunk) whose first token starts
    at character ``text_offset`` of the completion; also the offset after the last token.
    ``top_logprobs`` holds the most likely tokens and the chosen one, as OpenAI's."""
    tokens, offsets, tops = [], [], []
    for i in items:
        text = token_text(tokenizer, i.token)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        top = {token_text(tokenizer, t): lp for t, lp in i.top}
        tops.append({**top, text: i.logprob})
    body = {
        "tokens": tokens,
        "token_logprobs": [i.logprob for i in items],
        "top_logprobs": tops,
        "text_offset": offsets,
    }
    return body, text_offset
