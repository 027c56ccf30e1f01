"""The shared KV tier on a Redis Cluster against one Redis server (issue 72's targets).

Starts one ``redis-server`` and a Redis Cluster of three masters with a replica each (local
processes, ``ragblend.bench.redis_servers``), warms every question's chunks into both, then:

1. **TTFT**: per question, interleaved, ``--repeats`` times: full prefill, blend from the one
   server, blend from the cluster (tokenisation and KV loading included); the blend logits of
   the two tiers must be identical. ``cluster_over_single`` = median over questions of the
   cluster's TTFT over the single server's.
2. **Slot migration under load**: for ``--load-s`` seconds a client thread answers the questions
   (blend prefill from the cluster) while the main thread moves the slots of the warmed entries
   from master to master by hand (MIGRATE key by key, clients meet ASK redirections); counts
   failed requests, requests whose chunks missed, and first-token logits that differ from the
   undisturbed run.
3. **A master killed** (its replica takes over), then **a shard lost** (master and replica):
   every question answered; hits and misses counted.

Writes ``DIR/redis_cluster.json`` and ``DIR/redis_cluster.md``. Example::

    python benchmarks/store/redis_cluster.py --dataset ../shared/data/musique_dev.json \\
        --offset 12 --limit 8 --repeats 3 --load-s 60 --out benchmarks/results/intel-amx
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

from ragblend import BlendEngine
from ragblend.bench.datasets import default_dataset, load_cases
from ragblend.bench.environment import cpu_environment, environment
from ragblend.bench.harness import median
from ragblend.bench.redis_servers import RedisClusterNodes, RedisServer
from ragblend.store.redis import RedisStore


def timed_blend(engine: BlendEngine, store: RedisStore, case, mode: str = "blend"):
    """(TTFT ms, prefill) of ``case`` with ``store`` as the engine's tier."""
    engine.store = store
    t0 = time.perf_counter()
    prefill = engine.prefill(engine.tokenize(case.question, case.chunks), mode=mode)
    return (time.perf_counter() - t0) * 1e3, prefill


def ttft(engine, single, cluster, cases, repeats: int) -> dict:
    times: dict[str, list[list[float]]] = {
        m: [[] for _ in cases] for m in ("full", "single", "cluster")
    }
    for i, case in enumerate(cases):
        for r in range(repeats):
            ms, _ = timed_blend(engine, single, case, mode="full")
            times["full"][i].append(ms)
            ms, a = timed_blend(engine, single, case)
            times["single"][i].append(ms)
            ms, b = timed_blend(engine, cluster, case)
            times["cluster"][i].append(ms)
            if r == 0:
                if not torch.equal(a.logits, b.logits):
                    raise AssertionError(f"question {i}: cluster and single server logits differ")
                if b.stats.chunk_misses:
                    raise AssertionError(f"question {i}: {b.stats.chunk_misses} cluster misses")
    per_q = {m: [median(t) for t in ts] for m, ts in times.items()}
    return {
        "ttft_ms_median": {m: median(v) for m, v in per_q.items()},
        "speedup_vs_full": {
            m: median([f / x for f, x in zip(per_q["full"], per_q[m], strict=True)])
            for m in ("single", "cluster")
        },
        "cluster_over_single": median(
            [c / s for c, s in zip(per_q["cluster"], per_q["single"], strict=True)]
        ),
    }


def keys_per_master(store: RedisStore) -> dict[str, int]:
    client = store.client
    return {node.name: int(client.dbsize(target_nodes=node)) for node in client.get_primaries()}


def under_migration(engine, store, cluster, cases, seconds: float) -> dict:
    """Answers from a client thread while slots move; its first pass, before any slot moves,
    is the reference (the same thread: torch's threads sum in the same order)."""
    counts: Counter = Counter()
    stop, ready = threading.Event(), threading.Event()
    reference: list[torch.Tensor] = []

    def load() -> None:
        for case in cases:
            reference.append(timed_blend(engine, store, case)[1].logits)
        ready.set()
        while not stop.is_set():
            for case, want in zip(cases, reference, strict=True):
                try:
                    _, got = timed_blend(engine, store, case)
                except Exception as exc:  # a failed request is what this counts
                    counts["failed"] += 1
                    counts[f"error: {type(exc).__name__}"] += 1
                    continue
                counts["requests"] += 1
                counts["with_misses"] += bool(got.stats.chunk_misses)
                counts["differing"] += not torch.equal(got.logits, want)

    client = store.client
    slots = sorted({client.keyslot(name) for name in client.scan_iter(match="ragblend:*")})
    worker = threading.Thread(target=load)
    worker.start()
    ready.wait()
    deadline = time.monotonic() + seconds
    moved = 0
    try:
        while time.monotonic() < deadline:
            slot = slots[moved % len(slots)]
            masters = cluster.master_ports()
            source = cluster.owner_of(slot)
            target = masters[(masters.index(source) + 1) % len(masters)]
            cluster.migrate_slot(slot, source, target, pause=0.2)
            moved += 1
    finally:
        stop.set()
        worker.join()
    return {"seconds": seconds, "slots_moved": moved, **dict(counts)}


def answered(engine, store, cases) -> dict:
    counts: Counter = Counter()
    for case in cases:
        try:
            _, got = timed_blend(engine, store, case)
        except Exception as exc:
            counts[f"failed: {type(exc).__name__}"] += 1
            continue
        counts["answered"] += 1
        counts["chunk_hits"] += got.stats.chunk_hits
        counts["chunk_misses"] += got.stats.chunk_misses
    return dict(counts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default=str(default_dataset()))
    p.add_argument("--offset", type=int, default=0, help="skip the first N questions")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--load-s", type=float, default=60.0, help="seconds of load while migrating")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    engine = BlendEngine.from_pretrained("embedded")
    cases = load_cases(args.dataset, engine.tokenizer, limit=args.offset + args.limit)[
        args.offset :
    ]
    with tempfile.TemporaryDirectory(prefix="ragblend-cluster-bench-") as d:
        with (
            RedisServer(Path(d) / "single") as server,
            RedisClusterNodes(Path(d) / "cluster") as nodes,
        ):
            single, cluster = RedisStore(server.url), RedisStore(nodes.url)
            for store in (single, cluster):
                engine.store = store
                for case in cases:
                    engine.precompute(case.chunks)
                store.flush()
            timing = ttft(engine, single, cluster, cases, args.repeats)
            report = {
                "settings": {"model": "embedded", "n": len(cases), "repeats": args.repeats,
                             "offset": args.offset, **cpu_environment(),
                             "dtype": engine.config.dtype, "kv_dtype": engine.kv_dtype},
                **timing,
                "keys_per_master": keys_per_master(cluster),
                "migration_under_load": under_migration(engine, cluster, nodes, cases, args.load_s),
            }  # fmt: skip
            nodes.wait_until_replicated()
            nodes.kill_master(nodes.master_ports()[0])
            report["master_killed"] = answered(engine, cluster, cases)
            nodes.kill_shard(nodes.master_ports()[0])
            report["shard_lost"] = answered(engine, cluster, cases)
            for store in (single, cluster):
                store.close()
    report["environment"] = environment(torch.device("cpu"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "redis_cluster.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "redis_cluster.md").write_text(markdown(report))
    print(markdown(report))


def markdown(r: dict) -> str:
    t, s = r["ttft_ms_median"], r["speedup_vs_full"]
    m = r["migration_under_load"]
    return "\n".join([
        "# Redis Cluster (3 masters + replicas) vs one Redis server",
        "",
        f"CPU: {r['settings'].get('cpu')}.",
        "",
        f"{r['settings']['n']} questions × {r['settings']['repeats']} repeats, embedded model, "
        f"kv_dtype {r['settings']['kv_dtype']}",
        "",
        "| | TTFT ms (median) | speedup vs full |",
        "|---|---:|---:|",
        f"| full prefill | {t['full']:.0f} | 1.00× |",
        f"| blend, one Redis | {t['single']:.0f} | {s['single']:.2f}× |",
        f"| blend, Redis Cluster | {t['cluster']:.0f} | {s['cluster']:.2f}× |",
        "",
        "Cluster over one server (median of per-question ratios): "
        f"{r['cluster_over_single']:.3f}×. Keys per master: {r['keys_per_master']}.",
        "",
        f"Slot migration under {m['seconds']:.0f} s of load: {m.get('slots_moved', 0)} slots "
        f"moved, {m.get('requests', 0)} requests, {m.get('failed', 0)} failed, "
        f"{m.get('with_misses', 0)} with a miss, {m.get('differing', 0)} differing "
        "first-token logits.",
        "",
        f"Master killed (replica took over): {r['master_killed']}. "
        f"Shard lost: {r['shard_lost']}.",
        "",
    ])  # fmt: skip


if __name__ == "__main__":
    main()
