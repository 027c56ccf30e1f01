"""Blend TTFT with chunk KV in RAM vs in a shared Redis tier, interleaved per question.

Starts a private ``redis-server`` on a free loopback port (the Debian package; see
tests/redis_server.py), warms the same chunks into a RAM store and a Redis store, then measures
full prefill, blend from RAM and blend from Redis back to back per question (medians over
repeats), plus the Redis tier's per-layer fetch latency. Writes ``OUT/tier_compare.json``.

    python benchmarks/tier_compare.py --dataset ../shared/data/musique_dev.json --limit 10 \
        --out benchmarks/results/cpu
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from ragblend import BlendEngine
from ragblend.bench.datasets import load_cases
from ragblend.store import MemoryStore
from ragblend.store.redis import RedisStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from redis_server import RedisServer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    server = RedisServer(tempfile.mkdtemp(prefix="ragblend-redis-")).start()
    try:
        ram = BlendEngine.from_pretrained("embedded", store=MemoryStore())
        redis_store = RedisStore(server.url)
        redis = ram.with_config(store=redis_store)
        cases = load_cases(args.dataset, ram.tokenizer, 6, 512, args.limit)
        for case in cases:
            ram.precompute(case.chunks)
            redis.precompute(case.chunks)
        redis_store.flush()  # every write has landed in Redis
        variants = {
            "full": (ram, "full"),
            "blend_ram": (ram, "blend"),
            "blend_redis": (redis, "blend"),
        }
        ttft: dict[str, list[float]] = {name: [] for name in variants}
        hits: dict[str, list[int]] = {name: [] for name in variants}
        for case in cases:
            per: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, (engine, mode) in variants.items():
                    t0 = time.perf_counter()
                    pre = engine.prefill(engine.tokenize(case.question, case.chunks), mode)
                    per[name].append((time.perf_counter() - t0) * 1000)
                    hits[name].append(pre.stats.chunk_hits)
            for name in variants:
                ttft[name].append(statistics.median(per[name]))
        fetch_us, header_us = [], []
        for key in list(redis_store.keys())[:10]:
            t0 = time.perf_counter()
            entry = redis_store.get(key)
            header_us.append((time.perf_counter() - t0) * 1e6)
            assert entry is not None
            for i in range(entry.num_layers):
                t0 = time.perf_counter()
                entry.layer(i)
                fetch_us.append((time.perf_counter() - t0) * 1e6)
        result = {
            "settings": {
                "n": len(cases),
                "repeats": args.repeats,
                "top_k": 6,
                "chunk_tokens": 512,
                "dtype": str(ram.layers.dtype),
                "kv_dtype": ram.kv_dtype,
                "torch_threads": torch.get_num_threads(),
            },
            "ttft_ms_median": {k: statistics.median(v) for k, v in ttft.items()},
            "speedup_vs_full": {
                k: statistics.median(f / x for f, x in zip(ttft["full"], v))
                for k, v in ttft.items()
                if k != "full"
            },
            "redis_ttft_vs_ram": statistics.median(
                r / m for r, m in zip(ttft["blend_redis"], ttft["blend_ram"])
            ),
            "chunk_hits_min": {k: min(v) for k, v in hits.items()},
            "redis_header_get_us_median": statistics.median(header_us),
            "redis_layer_fetch_us_median": statistics.median(fetch_us),
            "redis_layer_fetch_us_p90": sorted(fetch_us)[int(0.9 * len(fetch_us))],
        }
        redis_store.close()
    finally:
        server.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tier_compare.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
