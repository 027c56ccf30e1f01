"""``ragblend serve`` speaks OpenAI as clients use it: cached tokens, logprobs, penalties,
refused and unknown fields — the real ``openai`` client against a real server."""

from __future__ import annotations

import logging

import httpx
import openai
import pytest
import torch
from conftest import CHUNKS, QUESTION
from helpers import tiny_model
from openai import OpenAI
from serving_server import ServerThread

from ragblend import BlendConfig, BlendEngine
from ragblend.matching import chunked_prompt
from ragblend.serving.app import create_app

MODEL = "tiny"
HI = [{"role": "user", "content": "Hi"}]
LOGPROB_ATOL = 1e-3  # the server decodes on LayerDecoder kernels, the reference runs HF's forward


@pytest.fixture(scope="module")
def engine(tokenizer):
    return BlendEngine(tiny_model("llama"), tokenizer, BlendConfig(), name=MODEL)


@pytest.fixture(scope="module")
def url(engine):
    with ServerThread(create_app(engine)) as url:
        yield url


@pytest.fixture(scope="module")
def oa(url) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def rag_messages() -> list[dict]:
    context = "\n\n".join(CHUNKS)
    return [{"role": "user", "content": f"Passages:\n{context}\n\nQuestion: {QUESTION}"}]


def reference(engine: BlendEngine, ids: list[int], steps: int) -> list[torch.Tensor]:
    """Greedy decoding by hand: the log-softmax of the engine's logits at each step."""
    rows, generated = [], []
    for _ in range(steps):
        pre = engine.full_prefill(ids + generated)
        rows.append(torch.log_softmax(pre.logits.float(), dim=-1))
        generated.append(int(torch.argmax(pre.logits)))
    return rows


def test_cached_tokens_count_warmed_chunks_and_zero_for_a_cold_prompt(engine, url, oa):
    cold = oa.chat.completions.create(model=MODEL, messages=HI, max_tokens=2)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    httpx.post(f"{url}/v1/ragblend/chunks", json={"texts": CHUNKS}, timeout=120)
    found = chunked_prompt(
        engine.tokenizer, rag_messages(), index=engine.known_chunks(), retrieved=()
    )
    chunk_tokens = sum(len(c) for c in found.chunks)
    first = oa.chat.completions.create(model=MODEL, messages=rag_messages(), max_tokens=2)
    assert first.model_extra["ragblend"]["chunk_hits"] == 3
    # the chunks came from the store; the head was computed (then stored in the prefix cache)
    assert first.usage.prompt_tokens_details.cached_tokens == chunk_tokens
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=rag_messages(),
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == chunk_tokens + len(found.head)
    full = oa.chat.completions.create(
        model=MODEL,
        messages=rag_messages(),
        max_tokens=2,
        extra_body={"ragblend": {"mode": "full"}},
    )
    assert full.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_logprobs_equal_the_engines_log_softmax(engine, oa):
    reply = oa.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 3
    rows = reference(engine, engine.chat_ids([{"role": "user", "content": "Hi"}]), 3)
    tok = engine.tokenizer
    for entry, row in zip(content, rows):
        chosen = int(torch.argmax(row))
        assert entry.token == tok.decode([chosen])
        assert entry.bytes == list(entry.token.encode("utf-8"))
        assert entry.logprob == pytest.approx(float(row[chosen]), abs=LOGPROB_ATOL)
        top = torch.topk(row, 3)
        assert [t.token for t in entry.top_logprobs] == [tok.decode([i]) for i in top.indices]
        got = [t.logprob for t in entry.top_logprobs]
        assert got == pytest.approx(top.values.tolist(), abs=LOGPROB_ATOL)
    assert "".join(e.token for e in content) == reply.choices[0].message.content


def test_completion_logprobs_have_openais_legacy_shape(engine, oa):
    reply = oa.completions.create(
        model=MODEL, prompt="Once upon", max_tokens=3, temperature=0, logprobs=2
    )
    lp = reply.choices[0].logprobs
    rows = reference(engine, engine.tokenizer("Once upon")["input_ids"], 3)
    expected = [float(row.max()) for row in rows]
    assert lp.token_logprobs == pytest.approx(expected, abs=LOGPROB_ATOL)
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert token in top and 2 <= len(top) <= 3
    assert "".join(lp.tokens) == reply.choices[0].text


def test_streamed_logprobs_cover_every_token(oa):
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=HI,
        max_tokens=4,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    entries = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == chunks[-1].usage.completion_tokens == 4


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": {"42": 5}}, "logit_bias"),
        ({"n": 2}, "n"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -1}, "seed"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_fields_that_would_change_the_output_are_refused_by_name(oa, extra, field):
    with pytest.raises(openai.BadRequestError) as refused:
        oa.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, extra_body=extra)
    error = refused.value.body
    assert error["param"] == field and field in error["message"]


def test_text_response_format_is_accepted(oa):
    reply = oa.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=1, response_format={"type": "text"}
    )
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_unknown_fields_are_accepted_with_one_warning_naming_them(oa, caplog):
    with caplog.at_level(logging.WARNING, logger="ragblend.serving"):
        reply = oa.chat.completions.create(
            model=MODEL, messages=HI, max_tokens=1, extra_body={"frobnicate": 1, "zorp": "x"}
        )
    assert reply.choices[0].finish_reason in ("stop", "length")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    named = [w for w in warnings if "frobnicate" in w]
    assert len(named) == 1 and "zorp" in named[0]


def test_penalties_change_the_output_as_the_engine_applies_them(engine, oa):
    prompt = "the the the the the"
    ids = engine.tokenizer(prompt)["input_ids"]

    def served(**penalties) -> str:
        out = oa.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=penalties
        )
        return out.choices[0].text

    def direct(**penalties) -> str:
        stream = engine.stream_prompt(list(ids), max_new_tokens=12, **penalties)
        return stream.collect().text

    for penalties in ({"repetition_penalty": 5.0}, {"frequency_penalty": 2.0}):
        assert served(**penalties) == direct(**penalties)
        assert served(**penalties) != served()
    assert served() == direct()
