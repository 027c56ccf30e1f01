"""``ragblend serve`` in operation: health, request ids, keep-alives, timeouts, keys, CORS,
tokenize, metrics — a real uvicorn server on a tiny fp32 model, real clients."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest
from helpers import tiny_model
from openai import AuthenticationError, OpenAI
from prometheus_client.parser import text_string_to_metric_families
from serving_server import ServerThread

from ragblend import BlendConfig, BlendEngine
from ragblend.cli import build_parser
from ragblend.serving.app import create_app
from ragblend.serving.command import api_keys, origins

MODEL = "tiny"
HI = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def make_engine(model, tokenizer) -> BlendEngine:
    return BlendEngine(model, tokenizer, BlendConfig(), name=MODEL)


def wait_for(check, what: str, limit_s: float = 60.0) -> None:
    """Poll ``check()`` until true (a bound on waiting, not a timed assertion)."""
    deadline = time.monotonic() + limit_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.02)


def samples(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_health_is_503_while_the_model_loads_then_200(model, tokenizer):
    loaded = threading.Event()

    def load() -> BlendEngine:
        loaded.wait(60)
        return make_engine(model, tokenizer)

    with ServerThread(create_app(load)) as url:
        loading = httpx.get(f"{url}/health")
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        early = httpx.post(f"{url}/v1/chat/completions", json=HI)
        assert early.status_code == 503
        assert early.json()["error"]["code"] == "service_unavailable"
        loaded.set()
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, "the model loaded")
        assert httpx.post(f"{url}/v1/chat/completions", json=HI, timeout=60).status_code == 200


def test_the_caller_thread_loads_and_computes_as_ragblend_serve_does(model, tokenizer):
    app = create_app(lambda: make_engine(model, tokenizer), scheduler_thread=False)
    with ServerThread(app) as url:
        assert httpx.get(f"{url}/health").json()["status"] == "loading"
        compute = threading.Thread(target=app.state.server.run, name="test-compute")
        compute.start()
        wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, "the model loaded")
        assert httpx.post(f"{url}/v1/chat/completions", json=HI, timeout=60).status_code == 200
        assert compute.is_alive()
    compute.join(timeout=30)  # the app's shutdown stopped the loop
    assert not compute.is_alive()


def test_a_dead_compute_loop_fails_its_requests_and_health_says_503(model, tokenizer):
    app = create_app(make_engine(model, tokenizer))
    with ServerThread(app) as url:
        assert httpx.get(f"{url}/health").status_code == 200

        def crash() -> None:
            raise RuntimeError("kernel exploded")

        app.state.scheduler._drop_cancelled = crash  # the loop's next step raises
        lost = httpx.post(f"{url}/v1/chat/completions", json=HI, timeout=60)
        assert lost.status_code == 503 and "kernel exploded" in lost.json()["error"]["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "kernel exploded" in health.json()["error"]
        assert httpx.post(f"{url}/v1/chat/completions", json=HI).status_code == 503


def test_requests_during_shutdown_get_503(model, tokenizer):
    app = create_app(make_engine(model, tokenizer))
    with ServerThread(app) as url:
        app.state.scheduler.stop()
        refused = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi"})
        assert refused.status_code == 503
        assert httpx.get(f"{url}/health").status_code == 503


def test_request_id_is_echoed_in_header_body_stream_and_log(model, tokenizer, caplog):
    with ServerThread(create_app(make_engine(model, tokenizer))) as url:
        with caplog.at_level(logging.INFO, logger="ragblend.serving"):
            given = {"X-Request-Id": "trace-42"}
            r = httpx.post(f"{url}/v1/chat/completions", json=HI, headers=given, timeout=60)
        assert r.headers["x-request-id"] == "trace-42"
        assert r.json()["ragblend"]["request_id"] == "trace-42"
        assert any("trace-42" in rec.getMessage() for rec in caplog.records)
        fresh = httpx.post(f"{url}/v1/chat/completions", json=HI, timeout=60)
        assert len(fresh.headers["x-request-id"]) == 32
        assert fresh.json()["ragblend"]["request_id"] == fresh.headers["x-request-id"]
        body = {**HI, "stream": True}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=given) as s:
            data = [x[6:] for x in s.iter_lines() if x.startswith("data: ")]
        assert json.loads(data[-2])["ragblend"]["request_id"] == "trace-42"
        assert httpx.get(f"{url}/health").headers["x-request-id"]


def test_a_queued_stream_gets_keep_alive_comments(model, tokenizer):
    app = create_app(make_engine(model, tokenizer), keepalive_s=0.05)
    gate = threading.Event()
    with ServerThread(app) as url:
        paused = app.state.scheduler.call(gate.wait)  # the compute thread is busy
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "stream": True}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as s:
                lines = s.iter_lines()
                first = next(x for x in lines if x)
                gate.set()
                rest = [x for x in lines if x]
        finally:
            gate.set()
        paused.result(timeout=10)
    assert first == ": keep-alive"
    assert rest[-1] == "data: [DONE]" and any(x.startswith("data: {") for x in rest)


def test_a_request_past_the_timeout_is_cancelled_with_an_error(model, tokenizer):
    app = create_app(make_engine(model, tokenizer), timeout_s=0.3, keepalive_s=0.05)
    gate = threading.Event()
    with ServerThread(app) as url:
        paused = app.state.scheduler.call(gate.wait)
        try:
            late = httpx.post(f"{url}/v1/chat/completions", json=HI, timeout=60)
            with httpx.stream(
                "POST", f"{url}/v1/chat/completions", json={**HI, "stream": True}, timeout=60
            ) as s:
                data = [x[6:] for x in s.iter_lines() if x.startswith("data: ")]
        finally:
            gate.set()
        paused.result(timeout=10)
        assert late.status_code == 408
        assert late.json()["error"]["code"] == "request_timeout"
        assert data[-1] == "[DONE]"
        assert json.loads(data[-2])["error"]["code"] == "request_timeout"
        wait_for(lambda: httpx.get(f"{url}/health").json()["waiting"] == 0, "queue drained")
        assert samples(url)["ragblend:request_errors_total"] >= 2


def test_any_of_several_api_keys_opens_v1_and_the_rest_stays_open(model, tokenizer):
    app = create_app(make_engine(model, tokenizer), api_key=["key-one", "key-two"])
    with ServerThread(app) as url:

        def client(key: str) -> OpenAI:
            return OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)

        assert client("key-one").models.list().data[0].id == MODEL
        assert client("key-two").models.list().data[0].id == MODEL
        with pytest.raises(AuthenticationError):
            client("key-three").models.list()
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200
        tok = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "a b"})
        assert tok.status_code == 200


def test_api_keys_come_from_flags_a_file_and_the_environment(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nfile-key-1\n\n  file-key-2  \n#old-key\n")
    keys = api_keys(["flag-key", "file-key-1"], str(key_file), "env-key")
    assert keys == ["flag-key", "file-key-1", "file-key-2", "env-key"]
    assert api_keys([], None, None) == []
    args = build_parser().parse_args(
        ["serve", "--api-key", "a", "--api-key", "b", "--allowed-origins", "http://x,http://y"]
        + ["--allowed-origins", "http://z", "--timeout", "30"]
    )
    assert args.api_key == ["a", "b"] and args.timeout == 30.0
    assert origins(args.allowed_origins) == ["http://x", "http://y", "http://z"]


def test_cors_answers_only_the_allowed_origins(model, tokenizer):
    engine = make_engine(model, tokenizer)
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    app = create_app(engine, allowed_origins=["https://app.example"], api_key="k")
    with ServerThread(app) as url:
        ok = httpx.options(f"{url}/v1/chat/completions", headers=preflight)
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(
            f"{url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"}
        )
        assert "access-control-allow-origin" not in other.headers
    with ServerThread(create_app(engine)) as url:
        plain = httpx.get(f"{url}/health", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in plain.headers


def test_tokenize_and_detokenize_round_trip(model, tokenizer):
    engine = make_engine(model, tokenizer)
    with ServerThread(create_app(engine)) as url:
        r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "Thomas Nabbes"})
        body = r.json()
        assert body["tokens"] == tokenizer("Thomas Nabbes")["input_ids"]
        assert body["count"] == len(body["tokens"])
        assert body["max_model_len"] == engine.context_window
        chat = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": HI["messages"]})
        assert chat.json()["tokens"] == engine.chat_ids([{"role": "user", "content": "Hi"}])
        back = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
        assert back.json() == {"prompt": "Thomas Nabbes"}
        both = {"model": MODEL, "prompt": "a", "messages": HI["messages"]}
        assert httpx.post(f"{url}/tokenize", json=both).status_code == 400
        bad = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": [-1]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        unknown = httpx.post(f"{url}/tokenize", json={"model": "gpt-4", "prompt": "a"})
        assert unknown.status_code == 404


def test_metrics_are_named_like_vllms(model, tokenizer):
    with ServerThread(create_app(make_engine(model, tokenizer))) as url:
        body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 4, "ignore_eos": True}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        got = samples(url)
    assert got["ragblend:prompt_tokens_total"] == len(tokenizer("Once upon")["input_ids"])
    assert got["ragblend:generation_tokens_total"] == 4
    assert got["ragblend:prompt_tokens_cached_total"] == 0
    assert got["ragblend:time_to_first_token_seconds_count"] == 1
    assert got["ragblend:e2e_request_latency_seconds_count"] == 1
    assert got["ragblend:inter_token_latency_seconds_count"] == 3
    assert got["ragblend:num_requests_running"] == 0
    assert got["ragblend:num_requests_waiting"] == 0
