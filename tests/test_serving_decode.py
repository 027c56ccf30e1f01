"""generate / stream and ``ragblend serve`` run one decode loop: same text, same finish_reason.

Each greedy request (temperature 0) is answered by the engine in-process (``stream_prompt``
over the chat ids) and by the server (streamed and not), for max_tokens, ignore_eos, an
end-of-sequence token and stop strings that span token boundaries.
"""

from __future__ import annotations

import pytest
from helpers import tiny_model
from openai import OpenAI
from serving_server import ServerThread

from ragblend import BlendConfig, BlendEngine
from ragblend.serving.app import create_app

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me about Oxford, née 1605 — 😀."}]
# greedy; the penalties keep a random model from repeating one token (they apply in both paths)
PENALTIES = {"frequency_penalty": 2.0, "presence_penalty": 2.0}


@pytest.fixture(scope="module")
def served(tokenizer):
    engine = BlendEngine(tiny_model("llama", seed=1), tokenizer, BlendConfig(), name=MODEL)
    app = create_app(engine, max_running=4, max_queue=8)
    with ServerThread(app) as url:
        yield engine, OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def in_process(engine: BlendEngine, **sampling) -> tuple[str, str, list[int]]:
    stream = engine.stream_prompt(engine.chat_ids(MESSAGES), **PENALTIES, **sampling)
    streamed = "".join(stream)
    result = stream.result
    assert result is not None and streamed == result.text
    return result.text, result.stats.finish_reason, result.token_ids


def served_answers(client: OpenAI, max_tokens: int, stop=None, ignore_eos=False) -> list[tuple]:
    """(text, finish_reason) of the chat request, streamed and not."""
    body = dict(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0, stop=stop)
    body |= PENALTIES
    extra = {"ignore_eos": ignore_eos}
    whole = client.chat.completions.create(**body, extra_body=extra)
    events = list(client.chat.completions.create(**body, extra_body=extra, stream=True))
    streamed = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    finish = [e.choices[0].finish_reason for e in events if e.choices][-1]
    return [(whole.choices[0].message.content, whole.choices[0].finish_reason), (streamed, finish)]


def test_max_tokens_and_ignore_eos(served):
    engine, client = served
    text, reason, ids = in_process(engine, max_new_tokens=40, ignore_eos=True)
    assert reason == "length" and len(ids) == 40
    assert served_answers(client, 40, ignore_eos=True) == [(text, "length")] * 2


def test_an_end_of_sequence_token_stops_both(served, monkeypatch):
    engine, client = served
    _, _, ids = in_process(engine, max_new_tokens=30, ignore_eos=True)
    at = next(i for i in range(3, 30) if ids[i] not in ids[:i])
    monkeypatch.setattr(engine, "eos_ids", {ids[at]})
    text, reason, kept = in_process(engine, max_new_tokens=30)
    assert reason == "stop" and kept == ids[:at]
    assert served_answers(client, 30) == [(text, "stop")] * 2
    text, reason, kept = in_process(engine, max_new_tokens=30, ignore_eos=True)
    assert reason == "length" and kept == ids
    assert served_answers(client, 30, ignore_eos=True) == [(text, "length")] * 2


def test_a_stop_string_across_tokens_cuts_both_the_same(served, tokenizer):
    engine, client = served
    full, _, ids = in_process(engine, max_new_tokens=48, ignore_eos=True)
    pieces = [tokenizer.decode([t]) for t in ids]
    k = next(i for i in range(1, len(ids) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]  # two characters from each of two tokens
    expected = full[: full.index(stop)]
    text, reason, _ = in_process(engine, max_new_tokens=48, ignore_eos=True, stop=[stop])
    assert (text, reason) == (expected, "stop")
    assert served_answers(client, 48, stop=[stop], ignore_eos=True) == [(expected, "stop")] * 2


def test_a_stop_string_that_never_occurs_changes_nothing(served):
    engine, client = served
    text, reason, _ = in_process(engine, max_new_tokens=24, ignore_eos=True)
    again = in_process(engine, max_new_tokens=24, ignore_eos=True, stop=["\x00never"])
    assert again[:2] == (text, reason) == (text, "length")
    assert served_answers(client, 24, stop=["\x00never"], ignore_eos=True) == [(text, reason)] * 2


def test_a_server_on_the_static_decode_pool_answers_as_the_engine_alone(tokenizer, monkeypatch):
    """decode_slots (a GPU's default) on CPU tensors: concurrent requests step in one pool,
    each answer the in-process one's."""
    from concurrent.futures import ThreadPoolExecutor

    from ragblend.decode.pool import DecodePool

    pooled_steps = []
    forward = DecodePool.forward

    def counted(self, *args, **kwargs):
        pooled_steps.append(int(args[0].numel()))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DecodePool, "forward", counted)

    engine = BlendEngine(
        tiny_model("llama", seed=1),
        tokenizer,
        BlendConfig(row_attention="masked", decode_slots=2, decode_pool_tokens=512),
        name=MODEL,
    )
    alone = engine.with_config(decode_slots=0)
    text, reason, _ = in_process(alone, max_new_tokens=24, ignore_eos=True)
    app = create_app(engine, max_running=4, max_queue=8)
    with ServerThread(app) as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        with ThreadPoolExecutor(4) as pool:  # 4 requests, 2 slots: some run in their own buffers
            answers = list(
                pool.map(lambda _: served_answers(client, 24, ignore_eos=True)[0], range(4))
            )
    assert answers == [(text, reason)] * 4
    assert pooled_steps and max(pooled_steps) == 2  # steps of both slots' requests together
