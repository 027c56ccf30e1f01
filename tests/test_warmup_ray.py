"""Warmup into the shared Redis tier: the CLIs (warmup, cache, bench) and a local Ray job."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import redis_server as fixtures
from conftest import tiny_model

from ragblend import BlendConfig, BlendEngine
from ragblend.cli import main
from ragblend.prompt import encode
from ragblend.store.redis import RedisStore, layer_field

redis_server = fixtures.redis_server
WORDS = "river mountain castle author poem novel city king battle college painter music".split()


def passage(i: int) -> str:
    rng = random.Random(i)
    return f"Passage {i}. " + " ".join(rng.choice(WORDS) for _ in range(20 + i % 5)) + "."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    cases = [
        {
            "question": f"Question {q}?",
            "answers": ["x"],
            "ctxs": [{"title": "", "text": passage(q * 2 + j)} for j in range(2)],
        }
        for q in range(3)
    ]
    path = tmp_path_factory.mktemp("data") / "musique.json"
    path.write_text(json.dumps(cases))
    return path


def engine_on(model_dir: Path, url: str, namespace: str | None = None) -> BlendEngine:
    return BlendEngine.from_pretrained(
        str(model_dir),
        config=BlendConfig(namespace=namespace),
        store=RedisStore(url, namespace=namespace),
    )


def test_warmup_into_redis_resumes_and_respects_namespaces(
    dataset, model_dir, redis_server, capsys
):
    args = [
        "warmup",
        "--dataset",
        str(dataset),
        "--model",
        str(model_dir),
        "--top-k",
        "2",
        "--chunk-tokens",
        "32",
        "--no-progress",
        "--redis-url",
        redis_server.url,
        "--namespace",
        "tenant-a",
    ]
    assert main(args) == 0
    assert "6 chunks stored, 0 already stored, 0 failed" in capsys.readouterr().out
    assert main(args) == 0  # resumable: everything is already there
    assert "0 chunks stored, 6 already stored" in capsys.readouterr().out
    from ragblend.bench.datasets import load_cases

    a = engine_on(model_dir, redis_server.url, "tenant-a")
    b = engine_on(model_dir, redis_server.url, "tenant-b")
    case = load_cases(dataset, a.tokenizer, 2, 32)[1]
    assert a.prefill(a.tokenize(case.question, case.chunks)).stats.chunk_hits == 2
    assert b.prefill(b.tokenize(case.question, case.chunks)).stats.chunk_hits == 0
    for e in (a, b):
        e.store.close()


def test_cache_cli_reports_verifies_and_drops_bad_redis_entries(
    dataset, model_dir, redis_server, capsys
):
    assert (
        main(
            [
                "warmup",
                "--dataset",
                str(dataset),
                "--model",
                str(model_dir),
                "--top-k",
                "2",
                "--chunk-tokens",
                "32",
                "--no-progress",
                "--redis-url",
                redis_server.url,
            ]
        )
        == 0
    )
    capsys.readouterr()
    cache = ["cache", "{}", "--redis-url", redis_server.url, "--json"]

    def report(command: str, *extra: str) -> tuple[int, dict]:
        code = main([c.format(command) for c in cache] + list(extra))
        return code, json.loads(capsys.readouterr().out)

    code, stats = report("stats")
    # 6 chunks, each with its first-chunk entry (exact_first_chunk), + canonical and prompt heads
    assert code == 0 and stats["entries"] == 14 and stats["bytes"] > 0
    assert report("stats", "--namespace", "other")[1]["entries"] == 0
    store = RedisStore(redis_server.url)
    key = next(iter(store.keys()))
    store.client.hset(store.redis_key(key), layer_field(0), b"garbage")
    code, verified = report("verify")
    assert code == 1 and verified["corrupt"] == 1 and verified["ok"] == 13
    code, collected = report("gc")
    assert code == 0 and collected["dropped"] == 1
    assert report("verify")[1] == {"ok": 13, "corrupt": 0, "foreign": 0, "errors": [], "dropped": 0}
    store.close()
    assert main(["cache", "stats", "--redis-url", "redis://127.0.0.1:1/0"]) == 2  # clean error


def test_bench_on_the_redis_tier_records_it_and_hits(dataset, model_dir, redis_server, tmp_path):
    out = tmp_path / "bench"
    assert (
        main(
            [
                "bench",
                "--dataset",
                str(dataset),
                "--model",
                str(model_dir),
                "--limit",
                "2",
                "--top-k",
                "2",
                "--chunk-tokens",
                "32",
                "--modes",
                "full,blend",
                "--repeats",
                "1",
                "--max-new-tokens",
                "2",
                "--tier",
                "redis",
                "--redis-url",
                redis_server.url,
                "--namespace",
                "bench",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert results["settings"]["tier"] == "redis"
    assert results["settings"]["namespace"] == "bench"
    assert RedisStore(redis_server.url, namespace="bench").ping()
    # 4 chunks, each also as a first chunk (exact_first_chunk), + the canonical precompute head
    # and the query's own prompt head
    assert results["settings"]["exact_first_chunk"] is True
    assert len(list(RedisStore(redis_server.url, namespace="bench").keys())) == 10


# ---------------------------------------------------------------------- Ray
@pytest.fixture(scope="module")
def local_ray():
    import ray  # a dev dependency: missing Ray fails, it does not skip

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_ray_warmup_of_a_chroma_collection_fills_redis_and_resumes(
    local_ray, model_dir, redis_server, tmp_path, capsys
):
    chromadb = pytest.importorskip("chromadb")
    client = chromadb.PersistentClient(path=str(tmp_path / "chroma"))
    col = client.create_collection("docs", embedding_function=None)
    docs = [passage(i) for i in range(10)]
    col.add(
        ids=[f"d{i}" for i in range(10)],
        documents=docs,
        embeddings=[[float(i), 1.0, 0.5] for i in range(10)],
    )
    args = [
        "warmup",
        "--chroma-path",
        str(tmp_path / "chroma"),
        "--collection",
        "docs",
        "--model",
        str(model_dir),
        "--redis-url",
        redis_server.url,
        "--namespace",
        "t1",
        "--ray",
        "--ray-actors",
        "2",
        "--batch-size",
        "3",
        "--no-progress",
    ]
    assert main(args) == 0
    assert "10 chunks stored, 0 already stored, 0 failed" in capsys.readouterr().out
    engine = engine_on(model_dir, redis_server.url, "t1")
    assert all(engine.is_cached(d) for d in docs)
    prefill = engine.prefill(engine.tokenize("Which river?", docs[:3]), mode="blend")
    assert prefill.stats.chunk_hits == 3
    context = engine.chunks.context_ids(engine.prompt_head())
    engine.store.discard(
        engine.chunk_key(context_ids=context, chunk_ids=encode(engine.tokenizer, docs[4]))
    )
    assert main(args) == 0  # resumable: only the dropped chunk is computed again
    assert "1 chunks stored, 9 already stored" in capsys.readouterr().out
    other = engine_on(model_dir, redis_server.url, "t2")
    assert not any(other.is_cached(d) for d in docs)
    engine.store.close()
    other.store.close()


def test_ray_warmup_needs_the_shared_tier(model_dir, dataset):
    assert main(["warmup", "--dataset", str(dataset), "--model", str(model_dir), "--ray"]) == 2
