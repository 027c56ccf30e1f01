"""``ragblend serve --ray``: two real Ray Serve replicas of a tiny model sharing a real Redis
Cluster (three masters, the URL of one node), one Ray instance and one deployment for the
module (chunk routing, load bound 0 so concurrent requests spread); the CLI's errors; no Ray
import without ``--ray``. (The benchmark, benchmarks/serving/chunk_routing.py, runs on a single
Redis server.)"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from conftest import tiny_model
from redis_cluster import RedisClusterNodes
from redis_server import free_port

from ragblend.cli import main

PASSAGES = [
    "The river Thames flows through London and into the North Sea estuary near Essex.",
    "Mount Everest is the highest mountain above sea level on the planet Earth, in Nepal.",
    "The novel was written by an author who lived in a small castle in the Scottish hills.",
    "A painter from Florence studied music at a college in Paris before the long battle.",
]
REPLICA_PREFIX = "SERVE_REPLICA::ragblend#ragblend-replica#"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-ray")
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(model_dir):
    """A Redis Cluster, a local Ray instance (2 CPUs) and the application: 2 replicas, chunk
    routing."""
    ray = pytest.importorskip("ray")
    from ray import serve

    from ragblend.serving.ray_replica import ReplicaSettings
    from ragblend.serving.ray_serve import RayOptions, start

    with (
        tempfile.TemporaryDirectory(prefix="ragblend-ray-") as d,
        RedisClusterNodes(Path(d), masters=3, replicas=0) as redis,
    ):
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        port = free_port()
        settings = ReplicaSettings(model=str(model_dir), redis_url=redis.url, max_tokens=8)
        try:
            start(settings, RayOptions(replicas=2, load_bound=0), port=port)
            url = f"http://127.0.0.1:{port}"
            with httpx.Client(base_url=url, timeout=120) as client:
                yield SimpleNamespace(client=client, model=str(model_dir), redis=redis, ray=ray)
        finally:
            serve.shutdown()
            ray.shutdown()


def chat(model: str, passages: list[str], question: str, **extra) -> dict:
    context = "\n\n".join(passages)
    content = f"Passages:\n{context}\n\nQuestion: {question}"
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def replicas_of(served) -> set[str]:
    health = served.client.get("/health").json()
    return {r for r, h in health["replicas"].items() if h["status"] == "ok"}


def test_the_api_answers_from_replicas_as_one_server_does(served):
    health = served.client.get("/health")
    assert health.status_code == 200 and len(health.json()["replicas"]) == 2
    assert health.json()["status"] == "ok" and health.json()["running"] == 0
    assert served.client.get("/v1/models").json()["data"][0]["id"] == served.model
    body = chat(served.model, PASSAGES[:1], "Where?", max_tokens=4, temperature=0)
    reply = served.client.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "r-1"})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "r-1"
    assert reply.json()["usage"]["completion_tokens"] == 4
    assert reply.json()["ragblend"]["request_id"] == "r-1"
    with served.client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert (
        "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[:-1])
        == reply.json()["choices"][0]["message"]["content"]
    )
    bad = served.client.post("/v1/chat/completions", json={**body, "n": 2})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "unsupported_field"


def test_a_chunk_warmed_through_one_replica_is_a_hit_on_every_replica(served):
    warmed = served.client.post("/v1/ragblend/chunks", json={"texts": PASSAGES[1:3]})
    assert warmed.status_code == 200 and warmed.json()["stored"] == 2

    def ask(i: int) -> httpx.Response:
        body = chat(served.model, PASSAGES[1:3], f"Question {i}?", max_tokens=8, ignore_eos=True)
        return served.client.post("/v1/chat/completions", json=body)

    # load bound 0: while the chunks' replica is busy, the next request goes to the other one
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(ask, range(12)))
    assert all(r.status_code == 200 for r in replies)
    assert {r.json()["ragblend"]["chunk_hits"] for r in replies} == {2}
    assert {r.headers["x-ragblend-replica"] for r in replies} == replicas_of(served)
    metrics = served.client.get("/metrics").text
    assert 'ragblend:routed_requests_total{reason="load"' in metrics
    assert metrics.count('ragblend:chunk_tier_hits_total{replica="') >= 2


def test_requests_with_the_same_chunks_follow_the_replica_that_served_them(served):
    body = chat(served.model, PASSAGES[:2], "Which river?", max_tokens=2)
    served.client.post("/v1/ragblend/chunks", json={"texts": PASSAGES[:2]})
    first = served.client.post("/v1/chat/completions", json=body)
    where = {
        served.client.post("/v1/chat/completions", json=body).headers["x-ragblend-replica"]
        for _ in range(4)
    }
    assert where == {first.headers["x-ragblend-replica"]}
    assert 'reason="affinity"' in served.client.get("/metrics").text


def test_a_killed_replica_fails_only_its_requests_and_comes_back(served):
    body = chat(served.model, PASSAGES[3:], "Long?", max_tokens=3000, ignore_eos=True)
    served.client.post("/v1/ragblend/chunks", json={"texts": PASSAGES[3:]})
    victim = served.client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
    doomed = victim.headers["x-ragblend-replica"]
    actor = served.ray.get_actor(REPLICA_PREFIX + doomed, namespace="serve")
    before = replicas_of(served)

    def stream() -> tuple[str, str]:
        with served.client.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True}
        ) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            return r.headers.get("x-ragblend-replica", ""), "\n".join(lines[-2:])

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = [pool.submit(stream) for _ in range(2)]
        time.sleep(1.5)  # both streams decode (load bound 0: one on each replica)
        served.ray.kill(actor, no_restart=True)
        ended = dict(f.result(timeout=300) for f in running)
    assert set(ended) == before  # one stream on each replica
    assert '"error"' in ended[doomed] and ended[doomed].endswith("data: [DONE]")
    (survivor,) = set(ended) - {doomed}
    assert '"finish_reason": "length"' in ended[survivor] and '"error"' not in ended[survivor]
    after = [
        served.client.post("/v1/chat/completions", json={**body, "max_tokens": 2}) for _ in range(3)
    ]
    assert [r.status_code for r in after] == [200, 200, 200]
    assert all(r.headers["x-ragblend-replica"] != doomed for r in after)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # Serve starts a replica in its place
        live = replicas_of(served)
        if len(live) == 2 and doomed not in live:
            break
        time.sleep(2)
    assert len(live) == 2 and doomed not in live


def test_serve_ray_needs_a_shared_store_and_its_flags_need_ray(capsys):
    assert main(["serve", "--ray"]) != 0
    assert "--redis-url" in capsys.readouterr().err
    assert main(["serve", "--ray", "--store-path", "/tmp/x"]) != 0
    assert "share chunks through the store" in capsys.readouterr().err
    assert main(["serve", "--replicas", "3"]) != 0
    assert "--replicas only apply with --ray" in capsys.readouterr().err


def test_serve_without_ray_never_imports_ray():
    code = (
        "import sys; from ragblend.cli import main; import ragblend.serving.command as c; "
        "import ragblend.serving.app; print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
