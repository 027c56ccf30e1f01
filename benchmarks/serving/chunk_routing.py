"""Chunk routing vs Ray Serve's default routing on ``ragblend serve --ray`` replicas.

    python benchmarks/serving/chunk_routing.py --out benchmarks/results/intel-amx

Starts a redis-server and a local Ray instance, warms the chunks of ``--groups`` MuSiQue dev
cases into Redis with ``ragblend warmup --redis-url`` (so every replica starts with an empty RAM
tier), then deploys ``--replicas`` replicas twice, back to back: with the chunk router and with
Serve's power-of-two-choices router (``--routing pow2``). Each deployment answers the same
``--requests`` chat requests (one seed): each asks one case's question over ``--per-request``
of its ``--top-k`` passages, drawn at random. Every replica's RAM tier holds
``--ram-fraction`` of the working set's chunk KV, so the replicas together hold it, one does not.

Measured per routing, from the replicas' ``ragblend:chunk_tier_hits_total{replica, tier}``:
the RAM-tier hit rate (chunks served from a replica's RAM tier / chunks served), and the TTFT
(client-side, to the first streamed token; and the server's ``ttft_ms``) p50 and mean. Writes
``chunk_routing.json`` and ``chunk_routing.png`` (``chunk_routing_<tag>.*`` with ``--tag``) under
``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from ragblend.bench.datasets import default_dataset, load_cases  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(directory: str) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        sys.exit("redis-server is not installed (make install)")
    port = free_port()
    cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", directory]
    proc = subprocess.Popen(cmd + ["--appendonly", "no"], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("redis-server did not start")


def workload(args: argparse.Namespace, tokenizer) -> list[dict]:
    """The requests (the same for both routings): a case's question over some of its passages,
    cut as ``ragblend warmup --dataset`` cuts them."""
    cases = load_cases(default_dataset(), tokenizer, args.top_k, args.chunk_tokens, args.groups)
    rng = random.Random(args.seed)
    requests = []
    for _ in range(args.requests):
        case = rng.choice(cases)
        context = "\n\n".join(rng.sample(case.chunks, args.per_request))
        content = f"Passages:\n{context}\n\nQuestion: {case.question}"
        requests.append({"messages": [{"role": "user", "content": content}]})
    return requests


def warm(args: argparse.Namespace, url: str) -> dict:
    """``ragblend warmup --redis-url``: every chunk into Redis (no replica's RAM tier). Only
    the chunks as any prompt reads them (no exact-first-chunk copies: a server's chat template
    never reads those), each precomputed alone."""
    cmd = [sys.executable, "-m", "ragblend.cli", "warmup", "--dataset", str(default_dataset())]
    cmd += ["--model", args.model, "--limit", str(args.groups), "--top-k", str(args.top_k)]
    cmd += ["--chunk-tokens", str(args.chunk_tokens), "--redis-url", url, "--no-progress"]
    cmd += ["--precompute-context", "canonical", "--no-exact-first-chunk"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=True)
    return {"seconds": round(time.perf_counter() - t0, 1), "summary": out.stdout.strip()}


def chunk_bytes(url: str, min_tokens: int) -> tuple[int, int]:
    """Bytes and count of the chunk KV entries in Redis: the working set (prompt heads, a few
    tokens each, left out)."""
    from ragblend.store.redis import RedisStore

    store = RedisStore(url)
    sizes = []
    for key in store.keys():
        entry = store.get(key)
        if entry is not None and entry.num_tokens >= min_tokens:
            sizes.append(entry.nbytes)
    store.close()
    return sum(sizes), len(sizes)


def tier_hits(client: httpx.Client) -> dict[str, dict[str, float]]:
    """``ragblend:chunk_tier_hits_total`` per replica and tier."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name == "ragblend:chunk_tier_hits":
            for s in family.samples:
                if s.name.endswith("_total"):
                    replica = out.setdefault(s.labels["replica"], {})
                    replica[s.labels["tier"]] = s.value
    return out


def ask(client: httpx.Client, model: str, request: dict, max_tokens: int) -> dict:
    body = {"model": model, "messages": request["messages"], "max_tokens": max_tokens}
    body |= {"temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first, info, replica = None, None, ""
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request failed: {r.status_code} {r.read().decode()[:300]}")
        replica = r.headers.get("x-ragblend-replica", "")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices") and event["choices"][0]["delta"]:
                if "role" not in event["choices"][0]["delta"]:  # a token, not the role event
                    first = time.perf_counter() - t0
            info = event.get("ragblend") or info
    info = info or {}
    return {
        "ttft_s": first,
        "server_ttft_ms": info.get("ttft_ms"),
        "replica": replica,
        "chunk_hits": info.get("chunk_hits"),
        "mode": info.get("mode"),
    }


def run_routing(args, settings, routing: str, requests: list[dict], port: int) -> dict:
    """Deploy with ``routing`` (fresh replicas: empty RAM tiers), answer ``requests``, delete."""
    from ray import serve

    from ragblend.serving.ray_serve import RayOptions, start

    t0 = time.perf_counter()
    start(settings, RayOptions(replicas=args.replicas, routing=routing), port=port)
    deployed = time.perf_counter() - t0
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        before = tier_hits(client)
        answers = [ask(client, settings.model, r, args.max_tokens) for r in requests]
        after = tier_hits(client)
    serve.delete("ragblend")
    ram = sum(v.get("ram", 0) for v in after.values()) - sum(
        v.get("ram", 0) for v in before.values()
    )
    served = sum(sum(v.values()) for v in after.values()) - sum(
        sum(v.values()) for v in before.values()
    )
    ttft = [a["ttft_s"] * 1000 for a in answers if a["ttft_s"] is not None]
    server = [a["server_ttft_ms"] for a in answers if a["server_ttft_ms"] is not None]
    return {
        "routing": routing,
        "deploy_s": round(deployed, 1),
        "ram_tier_hits": ram,
        "chunks_served": served,
        "ram_tier_hit_rate": round(ram / served, 4) if served else None,
        "ttft_ms_p50": round(statistics.median(ttft), 1),
        "ttft_ms_mean": round(statistics.fmean(ttft), 1),
        "server_ttft_ms_p50": round(statistics.median(server), 1),
        "requests_per_replica": {
            r: sum(a["replica"] == r for a in answers)
            for r in sorted({a["replica"] for a in answers})
        },
        "tier_hits_by_replica": after,
        "answers": answers,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = [r["routing"] for r in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.bar(names, [r["ram_tier_hit_rate"] for r in runs], color=["tab:green", "tab:gray"])
    a.set_title("RAM-tier hit rate (chunks)")
    a.set_ylim(0, 1)
    b.bar(names, [r["ttft_ms_p50"] for r in runs], color=["tab:green", "tab:gray"])
    b.set_title("TTFT p50 (ms, client)")
    fig.suptitle(
        f"{result['settings']['replicas']} replicas, {result['settings']['model']}, "
        f"{result['settings']['requests']} requests, {result['cpu']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4, help="MuSiQue cases (chunk groups)")
    ap.add_argument("--top-k", type=int, default=3, help="passages per case")
    ap.add_argument("--per-request", type=int, default=2, help="passages per request")
    ap.add_argument("--chunk-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--ram-fraction", type=float, default=0.55)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "intel-amx"))
    ap.add_argument("--tag", default="", help="file name suffix: chunk_routing<_tag>.json")
    args = ap.parse_args()

    import ray
    from transformers import AutoTokenizer

    from ragblend.models.loading import embedded_model_dir
    from ragblend.serving.ray_replica import ReplicaSettings

    tokenizer = AutoTokenizer.from_pretrained(
        embedded_model_dir() if args.model == "embedded" else args.model
    )
    requests = workload(args, tokenizer)
    with tempfile.TemporaryDirectory(prefix="chunk-routing-redis-") as d:
        redis, url = start_redis(d)
        try:
            warmed = warm(args, url)
            working_set, chunks = chunk_bytes(url, min(16, args.chunk_tokens // 2))
            ram_bytes = int(working_set * args.ram_fraction)
            settings = ReplicaSettings(
                model=args.model, redis_url=url, ram_bytes=ram_bytes, model_names=(args.model,)
            )
            ray.init(num_cpus=max(2, args.replicas), include_dashboard=False, log_to_driver=False)
            try:
                port = free_port()  # Serve's proxy keeps its port for both deployments
                runs = [run_routing(args, settings, r, requests, port) for r in ("chunk", "pow2")]
            finally:
                from ray import serve

                serve.shutdown()
                ray.shutdown()
        finally:
            redis.kill()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
         if line.startswith("model name")), platform.processor(),
    )  # fmt: skip
    chunk, pow2 = runs
    result = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "tag")},
        "warmup": warmed,
        "working_set_bytes": working_set,
        "working_set_chunks": chunks,
        "ram_tier_bytes_per_replica": ram_bytes,
        "runs": runs,
        "hit_rate_ratio": round(
            chunk["ram_tier_hit_rate"] / max(pow2["ram_tier_hit_rate"], 1e-9), 2
        ),
        "ttft_p50_ratio": round(chunk["ttft_ms_p50"] / pow2["ttft_ms_p50"], 3),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"chunk_routing_{args.tag}" if args.tag else "chunk_routing"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / f"{name}.png")
    for r in runs:
        print(
            f"{r['routing']:>5}: RAM-tier hit rate {r['ram_tier_hit_rate']:.2f} "
            f"({r['ram_tier_hits']:g}/{r['chunks_served']:g}), TTFT p50 {r['ttft_ms_p50']} ms "
            f"(server {r['server_ttft_ms_p50']} ms), per replica {r['requests_per_replica']}"
        )
    print(f"hit rate ratio {result['hit_rate_ratio']}, TTFT p50 ratio {result['ttft_p50_ratio']}")


if __name__ == "__main__":
    main()
