"""Blend TTFT with chunk KV in RAM vs in a shared Redis tier, interleaved per question.

Starts a private ``redis-server`` on a free loopback port (the Debian package; see
tests/redis_server.py), warms the same chunks into a RAM store and a Redis store, then measures
full prefill, blend from RAM and blend from Redis back to back per question (medians over
repeats), plus the Redis tier's round trips per query and fetch latencies: one layer of one
entry (``entry.layer(i)``) and one layer of every entry of a query in one pipelined round trip
(``RedisStore.fetch_layers``, what the layer loader issues). Writes ``OUT/tier_compare.json``.

``--layers-per-fetch 1 4`` adds a Redis variant per value (the first is ``blend_redis``, the
others ``blend_redis_lpf{N}``), all from the same server, interleaved with the rest;
``--unix-socket`` adds ``blend_redis_unix``: the same server through a unix socket.

    python benchmarks/store/tier_compare.py --dataset ../shared/data/musique_dev.json --limit 10 \
        --out benchmarks/results/intel-amx
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
from redis.utils import HIREDIS_AVAILABLE

from ragblend import BlendEngine
from ragblend.bench.datasets import load_cases
from ragblend.store import MemoryStore
from ragblend.store.redis import RedisEntry, RedisStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from redis_server import RedisServer  # noqa: E402


def redis_variant(lpf: int, first: int) -> str:
    return "blend_redis" if lpf == first else f"blend_redis_lpf{lpf}"


def fetch_latencies(store: RedisStore, engine: BlendEngine, cases) -> dict:
    """Per-entry and per-query (batched) layer fetch latencies of the stored chunks."""
    entry_us, batch_ms, header_us = [], [], []
    for case in cases:
        prompt = engine.tokenize(case.question, case.chunks)
        t0 = time.perf_counter()
        segments, _ = engine.chunks.lookup(prompt)  # the head and every chunk: what a query gets
        header_us.append((time.perf_counter() - t0) * 1e6 / (1 + len(case.chunks)))
        entries = [s.kv for s in segments if isinstance(s.kv, RedisEntry)]
        for i in range(entries[0].num_layers):
            t0 = time.perf_counter()
            store.fetch_layers(entries, i)
            batch_ms.append((time.perf_counter() - t0) * 1000)
        single = store.get(entries[-1].key)
        assert single is not None
        for i in range(single.num_layers):
            t0 = time.perf_counter()
            single.layer(i)
            entry_us.append((time.perf_counter() - t0) * 1e6)
    return {
        "redis_lookup_us_per_entry_median": statistics.median(header_us),
        "redis_layer_fetch_us_median": statistics.median(entry_us),
        "redis_layer_fetch_us_p90": sorted(entry_us)[int(0.9 * len(entry_us))],
        "redis_batched_layer_fetch_ms_median": statistics.median(batch_ms),
        "redis_batched_layer_fetch_ms_p90": sorted(batch_ms)[int(0.9 * len(batch_ms))],
        "entries_per_batched_fetch": len(entries),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers-per-fetch", type=int, nargs="+", default=[1])
    ap.add_argument("--unix-socket", action="store_true")
    ap.add_argument("--dtype", default="auto", help="compute dtype: auto / bfloat16 / float32")
    ap.add_argument("--kv-dtype", default="auto", help="storage dtype of chunk KV, both tiers")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="ragblend-redis-"))
    socket = tmp / "redis.sock"
    server = RedisServer(tmp, extra=["--unixsocket", str(socket), "--unixsocketperm", "700"])
    server.start()
    try:
        ram = BlendEngine.from_pretrained(
            "embedded", dtype=args.dtype, kv_dtype=args.kv_dtype, store=MemoryStore()
        )
        first = args.layers_per_fetch[0]
        stores = {
            redis_variant(n, first): RedisStore(server.url, layers_per_fetch=n)
            for n in args.layers_per_fetch
        }
        if args.unix_socket:
            stores["blend_redis_unix"] = RedisStore(f"unix://{socket}", layers_per_fetch=first)
        warm = next(iter(stores.values()))
        redis = ram.with_config(store=warm)
        cases = load_cases(args.dataset, ram.tokenizer, 6, 512, args.limit)
        for case in cases:
            ram.precompute(case.chunks)
            redis.precompute(case.chunks)
        warm.flush()  # every write has landed in Redis
        variants = {"full": (ram, "full"), "blend_ram": (ram, "blend")}
        variants.update({name: (ram.with_config(store=s), "blend") for name, s in stores.items()})
        ttft: dict[str, list[float]] = {name: [] for name in variants}
        hits: dict[str, list[int]] = {name: [] for name in variants}
        layer_trips: dict[str, list[int]] = {name: [] for name in stores}
        header_gets: list[int] = []
        for case in cases:
            per: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(args.repeats):
                for name, (engine, mode) in variants.items():
                    store = stores.get(name)
                    trips0 = store.layer_round_trips if store else 0
                    gets0 = store.stats.hits + store.stats.misses if store else 0
                    t0 = time.perf_counter()
                    pre = engine.prefill(engine.tokenize(case.question, case.chunks), mode)
                    per[name].append((time.perf_counter() - t0) * 1000)
                    hits[name].append(pre.stats.chunk_hits)
                    if store is not None:
                        layer_trips[name].append(store.layer_round_trips - trips0)
                        header_gets.append(store.stats.hits + store.stats.misses - gets0)
            for name in variants:
                ttft[name].append(statistics.median(per[name]))
        latencies = fetch_latencies(stores["blend_redis"], redis, cases)
        result = {
            "settings": {
                "n": len(cases),
                "repeats": args.repeats,
                "top_k": 6,
                "chunk_tokens": 512,
                "dtype": str(ram.layers.dtype),
                "kv_dtype": ram.kv_dtype,
                "layers": ram.layers.num_layers,
                "layers_per_fetch": {name: s.layers_per_fetch for name, s in stores.items()},
                "redis_url": "redis://127.0.0.1 (TCP loopback); _unix: unix socket",
                "hiredis": HIREDIS_AVAILABLE,
                "torch_threads": torch.get_num_threads(),
            },
            "ttft_ms_median": {k: statistics.median(v) for k, v in ttft.items()},
            "speedup_vs_full": {
                k: statistics.median(f / x for f, x in zip(ttft["full"], v, strict=True))
                for k, v in ttft.items()
                if k != "full"
            },
            "redis_ttft_vs_ram": {
                name: statistics.median(
                    r / m for r, m in zip(ttft[name], ttft["blend_ram"], strict=True)
                )
                for name in stores
            },
            "chunk_hits_min": {k: min(v) for k, v in hits.items()},
            "redis_layer_round_trips_per_query": {
                name: statistics.median(v) for name, v in layer_trips.items()
            },
            "redis_header_gets_per_query": statistics.median(header_gets),
            **latencies,
        }
        for store in stores.values():
            store.close()
    finally:
        server.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tags = [t for t in (args.dtype, f"kv_{args.kv_dtype}") if t not in ("auto", "kv_auto")]
    name = "_".join(["tier_compare", *tags]) + ".json"
    (out / name).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
