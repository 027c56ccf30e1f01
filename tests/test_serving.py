"""``ragblend serve`` end to end: a real uvicorn server on a tiny fp32 model, real clients."""

from __future__ import annotations

import json
import logging
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis_server as fixtures
from conftest import CHUNKS, QUESTION
from helpers import tiny_model
from openai import APIStatusError, AuthenticationError, OpenAI
from prometheus_client.parser import text_string_to_metric_families
from serving_server import ServerThread

from ragblend import BlendConfig, BlendEngine
from ragblend.serving.app import create_app
from ragblend.serving.command import warn_if_exposed
from ragblend.store import DiskStore
from ragblend.store.cli import StoreFlags, open_store

MODEL = "tiny"
redis_server = fixtures.redis_server


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def make_engine(model, tokenizer, store=None) -> BlendEngine:
    return BlendEngine(model, tokenizer, BlendConfig(), store=store, name=MODEL)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    app = create_app(make_engine(model, tokenizer), max_running=4, max_queue=8)
    with ServerThread(app) as url:
        yield url, app


def client(url: str, key: str = "none") -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)


def rag_messages(chunks=CHUNKS, question=QUESTION) -> list[dict]:
    context = "\n\n".join(chunks)
    return [
        {"role": "system", "content": "Answer from the passages."},
        {"role": "user", "content": f"Passages:\n{context}\n\nQuestion: {question}"},
    ]


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def warm(url: str, texts) -> dict:
    r = httpx.post(f"{url}/v1/ragblend/chunks", json={"texts": list(texts)}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_and_completion_answer_with_the_ragblend_object(server):
    url, _ = server
    oa = client(url)
    chat = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].finish_reason in ("length", "stop")
    info = chat.model_extra["ragblend"]
    keys = {"mode", "ttft_ms", "chunk_hits", "chunk_misses", "fallback_reason", "request_id"}
    assert set(info) == keys | {"fallback_message"}
    assert info["mode"] == "full" and info["fallback_reason"] == "no_known_chunk"  # in "Hi"
    assert "precompute the chunks" in info["fallback_message"]
    text = oa.completions.create(model=MODEL, prompt="Once upon", max_tokens=3, temperature=0)
    assert text.usage.completion_tokens <= 3
    assert text.model_extra["ragblend"]["ttft_ms"] > 0
    assert [m.id for m in oa.models.list().data] == [MODEL]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_ends_with_done_and_its_last_event_carries_ragblend(server, path):
    url, _ = server
    body = {"model": MODEL, "max_tokens": 5, "temperature": 0, "stream": True, "ignore_eos": True}
    body |= {"messages": rag_messages()} if "chat" in path else {"prompt": "Hello there"}
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert all("ragblend" not in e for e in events[:-1])
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["ragblend"]["mode"] in ("full", "blend")


def test_warmed_chunks_blend_and_full_mode_can_be_asked_for(server):
    url, _ = server
    assert warm(url, CHUNKS)["stored"] + warm(url, CHUNKS)["already_stored"] >= len(CHUNKS)
    oa = client(url)
    blend = oa.chat.completions.create(model=MODEL, messages=rag_messages(), max_tokens=3)
    info = blend.model_extra["ragblend"]
    assert info["mode"] == "blend" and info["chunk_hits"] == 3 and info["chunk_misses"] == 0
    full = oa.chat.completions.create(
        model=MODEL,
        messages=rag_messages(),
        max_tokens=3,
        extra_body={"ragblend": {"mode": "full"}},
    )
    assert full.model_extra["ragblend"]["mode"] == "full"
    stream = oa.chat.completions.create(
        model=MODEL, messages=rag_messages(), max_tokens=3, stream=True
    )
    last = list(stream)[-1]
    assert last.model_extra["ragblend"]["chunk_hits"] == 3
    assert metric(url, "ragblend:chunk_hits_total") >= 6
    assert metric(url, "ragblend:time_to_first_token_seconds_count", mode="blend") >= 2


def test_batched_greedy_decoding_equals_each_request_alone(server):
    url, app = server
    prompts = ["The history of the river", "Thomas Nabbes was", "1 2 3 4", "A recipe for bread:"]

    def ask(prompt: str) -> str:
        out = client(url).completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return out.choices[0].text

    alone = [ask(p) for p in prompts]
    app.state.scheduler.largest_batch = 0
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(ask, prompts))
    assert app.state.scheduler.largest_batch >= 2  # they really decoded as one batch
    assert together == alone


def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(server):
    url, _ = server
    path = f"{url}/v1/chat/completions"
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    cases = [
        (httpx.post(path, content=b"{not json", headers={"content-type": "application/json"}), 400),
        (httpx.post(path, json={**ok, "model": "gpt-4"}), 404),
        (httpx.post(path, json={**ok, "temperature": 7}), 400),
        (httpx.post(path, json={**ok, "top_p": 0}), 400),
        (httpx.post(path, json={**ok, "max_tokens": 0}), 400),
        (
            httpx.post(path, json={**ok, "messages": [{"role": "user", "content": "w " * 5000}]}),
            400,
        ),
        (httpx.post(f"{url}/v1/completions", json={"model": MODEL}), 400),
        (httpx.post(f"{url}/v1/ragblend/chunks", json={"texts": []}), 400),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert cases[1][0].json()["error"]["code"] == "model_not_found"
    assert cases[5][0].json()["error"]["code"] == "context_length_exceeded"
    assert httpx.post(path, json=ok, timeout=60).status_code == 200


def test_full_queue_answers_429_and_a_disconnected_stream_frees_its_slot(model, tokenizer):
    app = create_app(make_engine(model, tokenizer), max_running=1, max_queue=0)
    scheduler = app.state.scheduler
    body = {"model": MODEL, "prompt": "Tell", "max_tokens": 3000, "ignore_eos": True}
    gate = threading.Event()
    with ServerThread(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)  # the first token: the request holds the only slot
            paused = scheduler.call(gate.wait)  # hold the compute thread between two steps
            busy = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1})
            assert busy.status_code == 429
            assert busy.json()["error"]["code"] == "rate_limit_exceeded"
        time.sleep(0.3)  # the connection is closed; the server sees the disconnect
        gate.set()
        paused.result(timeout=10)
        deadline = time.monotonic() + 20  # the request is dropped at the next step
        while httpx.get(f"{url}/health").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(f"{url}/health").json()["running"] == 0
        assert metric(url, "ragblend:cancelled_requests_total") == 1
        assert metric(url, "ragblend:generation_tokens_total") < 2999
        after = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2})
        assert after.status_code == 200


def test_api_key_is_required_except_for_health(model, tokenizer, caplog):
    app = create_app(make_engine(model, tokenizer), api_key="s3cret")
    with ServerThread(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        missing = httpx.get(f"{url}/v1/models")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(AuthenticationError):
            client(url, "wrong").models.list()
        assert client(url, "s3cret").models.list().data[0].id == MODEL
        with pytest.raises(APIStatusError):
            client(url, "wrong").chat.completions.create(model=MODEL, messages=[], max_tokens=1)
    with caplog.at_level(logging.WARNING, logger="ragblend.serving.command"):
        assert warn_if_exposed("0.0.0.0", None)
        assert not warn_if_exposed("0.0.0.0", "k") and not warn_if_exposed("127.0.0.1", None)
        assert not warn_if_exposed("::1", None) and not warn_if_exposed("localhost", None)
    assert "without an API key" in caplog.text


def test_chunks_another_engine_warmed_into_the_disk_store_hit(model, tokenizer, tmp_path):
    writer = make_engine(model, tokenizer, store=DiskStore(tmp_path / "kv", fsync=False))
    assert writer.precompute(CHUNKS) == len(CHUNKS)
    texts = tmp_path / "kv" / "texts"
    assert stat.S_IMODE(texts.stat().st_mode) == 0o700
    assert stat.S_IMODE((texts / "chunk_texts.sqlite").stat().st_mode) == 0o600
    engine = make_engine(
        model, tokenizer, store=open_store(StoreFlags(str(tmp_path / "kv")), ram_front=True)
    )
    with ServerThread(create_app(engine)) as url:
        reply = client(url).chat.completions.create(
            model=MODEL, messages=rag_messages(), max_tokens=2
        )
    assert reply.model_extra["ragblend"]["mode"] == "blend"
    assert reply.model_extra["ragblend"]["chunk_hits"] == 3


def test_chunks_found_but_missed_are_precomputed_again_between_steps(model, tokenizer):
    engine = make_engine(model, tokenizer)
    with ServerThread(create_app(engine)) as url:
        warm(url, CHUNKS)
        engine.store.clear()  # the KV evicted; the texts are still known
        chat = client(url).chat.completions.create
        first = chat(model=MODEL, messages=rag_messages(), max_tokens=2).model_extra["ragblend"]
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health").json()["rewarming"] and time.monotonic() < deadline:
            time.sleep(0.05)
        again = chat(model=MODEL, messages=rag_messages(), max_tokens=2).model_extra["ragblend"]
    assert first["chunk_misses"] == 3 and first["mode"] == "full"
    assert again["chunk_hits"] == 3 and again["mode"] == "blend"


def test_two_servers_on_one_redis_tier_share_warmed_chunks(model, tokenizer, redis_server):
    engines = [
        make_engine(
            model,
            tokenizer,
            store=open_store(StoreFlags(None, redis_server.url, "t26"), ram_front=True),
        )
        for _ in range(2)
    ]
    with (
        ServerThread(create_app(engines[0])) as first,
        ServerThread(create_app(engines[1])) as second,
    ):
        warm(first, CHUNKS)
        engines[0].store.tiers[-1].flush()  # Redis writes are asynchronous
        reply = client(second).chat.completions.create(
            model=MODEL, messages=rag_messages(), max_tokens=2
        )
    assert reply.model_extra["ragblend"]["chunk_hits"] == 3


def test_langchain_chat_openai_rag_chain_blends(server):
    from langchain_core.documents import Document
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableLambda, RunnablePassthrough
    from langchain_openai import ChatOpenAI

    url, _ = server
    warm(url, CHUNKS)
    docs = [Document(page_content=c) for c in CHUNKS]
    retriever = RunnableLambda(lambda question: docs)
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context.\n\n{context}"), ("human", "{question}")]
    )
    llm = ChatOpenAI(
        base_url=f"{url}/v1",
        api_key="none",
        model=MODEL,
        max_tokens=4,
        temperature=0,
        include_response_headers=True,
    )
    join = RunnableLambda(lambda ds: "\n\n".join(d.page_content for d in ds))
    chain = {"context": retriever | join, "question": RunnablePassthrough()} | prompt | llm
    hits = metric(url, "ragblend:chunk_hits_total")
    message = chain.invoke(QUESTION)
    info = json.loads(message.response_metadata["headers"]["x-ragblend"])
    assert info["mode"] == "blend" and info["chunk_hits"] == 3
    assert metric(url, "ragblend:chunk_hits_total") == hits + 3
    assert isinstance((chain | StrOutputParser()).invoke(QUESTION), str)


def test_llama_index_openai_like_call_blends(server):
    pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT
    from llama_index.llms.openai_like import OpenAILike

    url, _ = server
    warm(url, CHUNKS)
    llm = OpenAILike(
        model=MODEL,
        api_base=f"{url}/v1",
        api_key="none",
        is_chat_model=True,
        context_window=4096,
        max_tokens=4,
        temperature=0,
    )
    hits = metric(url, "ragblend:chunk_hits_total")
    prompt = DEFAULT_TEXT_QA_PROMPT.format(context_str="\n\n".join(CHUNKS), query_str=QUESTION)
    assert isinstance(llm.complete(prompt).text, str)
    assert metric(url, "ragblend:chunk_hits_total") == hits + 3
