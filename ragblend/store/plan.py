"""``ragblend cache plan``: what a corpus of chunks costs, and which tier's loading blend hides.

The paper's storage-device choice (§5.1): a tier is usable when loading a prompt's chunk KV from
it takes no longer than recomputing blend's share of the prompt. For a model and storage codec
this measures, on this machine:

- the bytes a chunk's stored entries take (every entry precompute writes for it at the
  configuration's defaults, read back from the store), and the corpus's total;
- the warmup rate: sample chunks precomputed as ``ragblend warmup`` does, in the steady state of
  a corpus being warmed (each after two chunks already stored, as its neighbours, where the
  precompute context is a neighbour context);
- per tier (RAM, disk, Redis where ``--redis-url`` is given): the time to load a prompt's
  ``top_k`` chunk entries (read at the tier's measured bandwidth plus decoding every layer)
  against ``ratio`` × a full prefill of that prompt, and whether the load is hidden.

``--model`` also takes a shape of ``ragblend.bench.shapes`` (e.g. ``llama-3.1-8b``): random
weights, chunks of random token ids, and every time measured on the shape's first
:data:`SHAPE_LAYERS` layers and scaled to all of them (bytes per layer are the same on every
layer; compute per layer is too). Without a tokenizer a shape's chunks are precomputed after
the prompt head alone (``precompute_context`` ``prefix``: one entry per chunk, no neighbours),
which the plan records.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from typing import Any

from ragblend.store.base import KVEntry

SHAPE_LAYERS = 2
SAMPLES = 3


def add_plan_parser(cmds) -> None:
    from ragblend.config import kv_dtype_argument

    p = cmds.add_parser(
        "plan",
        help="bytes, warmup time and per-tier load vs recompute for a corpus of chunks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="embedded", help="'embedded', a model path or a shape")
    p.add_argument("--chunks", type=int, required=True, help="chunks in the corpus")
    p.add_argument("--chunk-tokens", type=int, default=512, help="tokens per chunk (512)")
    p.add_argument("--kv-dtype", type=kv_dtype_argument, default="auto", metavar="D")
    p.add_argument("--top-k", type=int, default=6, help="chunks per prompt (6)")
    p.add_argument("--ratio", type=float, default=None, help="recompute ratio (engine default)")
    p.add_argument("--dtype", default="auto", help="compute dtype (auto)")
    p.add_argument("--store-path", default=None, help="directory whose disk bandwidth counts")
    p.add_argument("--redis-url", default=None, help="also plan the Redis tier at this URL")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def run_plan(args: argparse.Namespace) -> int:
    import json

    from ragblend.errors import RagblendError

    if args.chunks < 1 or args.chunk_tokens < 1 or args.top_k < 1:
        raise RagblendError("--chunks, --chunk-tokens and --top-k must be >= 1")
    report = plan(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(describe(report))
    return 0


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The plan as a JSON-able dict (see the module docstring)."""
    from ragblend import cpu
    from ragblend.controller import measure_disk_bandwidth, measure_ram_bandwidth
    from ragblend.store.memory import MemoryStore

    store = MemoryStore(1 << 40)
    engine, scale, samples, head = _engine(args, store)
    cache = engine.chunks
    t0 = time.perf_counter()
    if args.model in _shapes():
        _calibrate_from_ids(engine, samples)
    cache.load_basis(create=True)
    calibration_s = time.perf_counter() - t0
    # steady state: the neighbours are chunks the corpus has stored already
    samples, warm = samples[:SAMPLES], samples[SAMPLES:]
    for ids in warm:
        cache.precompute_ids(ids, head)
    t0 = time.perf_counter()
    for ids in samples:
        cache.precompute_ids(ids, head, neighbours=cache_neighbours(engine, warm))
    per_chunk_s = (time.perf_counter() - t0) / len(samples) * scale
    stored = cache.stored_entries(samples, head)
    if len(stored) != len(samples):
        raise RuntimeError("a precomputed sample is not in the plan's store")
    tokens = sum(map(len, samples))
    per_token = sum(e.nbytes for entries in stored for e in entries) / tokens
    bytes_per_chunk = per_token * args.chunk_tokens * scale
    own = [entries[0] for entries in stored]  # the entry a prompt reads for each chunk
    entry_bytes = sum(e.nbytes for e in own) / tokens * args.chunk_tokens * scale
    decode_ms = _decode_ms(own) * scale * args.chunk_tokens / _mean_len(samples)
    prompt_tokens = len(head) + args.top_k * args.chunk_tokens
    prefill_ms = _prefill_ms(engine, prompt_tokens) * scale
    ratio = float(engine.config.ratio if args.ratio is None else args.ratio)
    device = engine.layers.device
    bandwidths = {"ram": measure_ram_bandwidth(device)}
    disk_dir = args.store_path or tempfile.mkdtemp(prefix="ragblend-plan-")
    bandwidths["disk"] = measure_disk_bandwidth(disk_dir, device)
    if args.redis_url:
        bandwidths["redis"] = _redis_bandwidth(args.redis_url)
    tiers = {}
    for name, bandwidth in bandwidths.items():
        load = args.top_k * (entry_bytes / bandwidth * 1000 + decode_ms)
        recompute = ratio * prefill_ms
        tiers[name] = {
            "load_ms": load,
            "recompute_ms": recompute,
            "hidden": load <= recompute,
            "bandwidth_bytes_per_s": bandwidth,
            "decode_ms_per_chunk": decode_ms,
        }
    rate = 1.0 / per_chunk_s if per_chunk_s > 0 else float("inf")
    return {
        "model": args.model,
        "kv_dtype": engine.kv_dtype,
        "chunk_tokens": args.chunk_tokens,
        "chunks": args.chunks,
        "entries_per_chunk": max(len(entries) for entries in stored),
        "bytes_per_token": bytes_per_chunk / args.chunk_tokens,
        "bytes_per_chunk": bytes_per_chunk,
        "corpus_bytes": bytes_per_chunk * args.chunks,
        "warmup_chunks_per_s": rate,
        "warmup_hours": args.chunks / rate / 3600,
        "calibration_s": calibration_s * scale,
        "prompt_tokens": prompt_tokens,
        "ratio": ratio,
        "prefill_ms": prefill_ms,
        "tiers": tiers,
        "measured_layers": f"{SHAPE_LAYERS} of the shape's, scaled" if scale != 1 else "all",
        "precompute_context": engine.config.precompute_context,
        "dtype": str(engine.layers.dtype).removeprefix("torch."),
        **cpu.describe(),
    }


def describe(report: dict[str, Any]) -> str:
    """The plan in words."""
    gib = 1 << 30
    entries = report["entries_per_chunk"]
    lines = [
        f"{report['model']} · kv_dtype {report['kv_dtype']} · {report['chunk_tokens']}-token "
        f"chunks, {entries} entr{'y' if entries == 1 else 'ies'} each",
        f"bytes per chunk  {report['bytes_per_chunk'] / (1 << 20):,.2f} MiB "
        f"({report['bytes_per_token']:,.0f} B/token)",
        f"corpus           {report['chunks']:,} chunks: {report['corpus_bytes'] / gib:,.1f} GiB",
        f"warmup           {report['warmup_chunks_per_s']:.2f} chunks/s here: "
        f"{report['warmup_hours']:,.1f} h",
        f"a prompt of {report['prompt_tokens']} tokens: full prefill {report['prefill_ms']:,.0f} "
        f"ms, blend recomputes {report['ratio']:.2f} of it",
    ]
    for name, tier in report["tiers"].items():
        verdict = "hidden" if tier["hidden"] else "NOT hidden"
        lines.append(
            f"  {name:<6} load {tier['load_ms']:,.0f} ms vs recompute {tier['recompute_ms']:,.0f} "
            f"ms: {verdict} ({tier['bandwidth_bytes_per_s'] / gib:.2f} GiB/s, decode "
            f"{tier['decode_ms_per_chunk']:.1f} ms/chunk)"
        )
    return "\n".join(lines)


def cache_neighbours(engine, others: list[list[int]]) -> list[list[int]]:
    """The neighbours a sample chunk is precomputed after (none outside neighbour contexts)."""
    from ragblend.config import NEIGHBOUR_CONTEXTS

    return others if engine.config.precompute_context in NEIGHBOUR_CONTEXTS else []


def _shapes() -> dict:
    from ragblend.bench.shapes import SHAPES

    return SHAPES


def _engine(args: argparse.Namespace, store) -> tuple[Any, float, list[list[int]], list[int]]:
    """(engine, factor from measured layers to all, sample chunks' ids, prompt head)."""
    from ragblend.engine import BlendEngine

    config: dict[str, Any] = {"kv_dtype": args.kv_dtype, "dtype": args.dtype}
    if args.model in _shapes():
        import torch

        from ragblend.bench.shapes import SHAPES, random_ids, shape_engine
        from ragblend.models.dtype import resolve_dtype

        layers = int(SHAPES[args.model]["num_hidden_layers"])
        dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")
        engine, _ = shape_engine(
            args.model,
            torch.device("cpu"),
            dtype,
            seed=0,
            store=store,
            model_overrides={"num_hidden_layers": SHAPE_LAYERS},
            kv_dtype=args.kv_dtype,
        )
        rng = random.Random(0)
        vocab = int(engine.model.config.vocab_size)
        samples = [random_ids(rng, args.chunk_tokens, vocab) for _ in range(SAMPLES + 2)]
        return engine, layers / SHAPE_LAYERS, samples, random_ids(rng, 16, vocab)
    from ragblend.prompt import encode
    from ragblend.store.basis import CALIBRATION_CHUNKS, calibration_texts

    engine = BlendEngine.from_pretrained(args.model, store=store, **config)
    texts = calibration_texts(CALIBRATION_CHUNKS + SAMPLES + 2)[CALIBRATION_CHUNKS:]
    samples = [encode(engine.tokenizer, t)[: args.chunk_tokens] for t in texts]
    head = engine.tokenize("?", ["x"]).head
    return engine, 1.0, samples, head


def _calibrate_from_ids(engine, samples: list[list[int]]) -> None:
    """A random-weight shape has no tokenizer for the calibration passages: its basis is
    calibrated from the sample chunks (random ids) instead."""
    from ragblend.store import basis as bases
    from ragblend.store.quant import needs_basis

    cache = engine.chunks
    if needs_basis(cache.kv_dtype) and cache.load_basis() is None:
        kvs = [cache.compute_kv(ids, []) for ids in samples]
        cache.store.put(cache.basis_key, bases.as_entry(bases.calibrate_from(kvs), {}))


def _decode_ms(entries: list[KVEntry]) -> float:
    """Median ms to decode every layer of one entry to the compute dtype."""
    times = []
    for entry in entries:
        t0 = time.perf_counter()
        for i in range(entry.num_layers):
            entry.layer(i)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _mean_len(samples: list[list[int]]) -> float:
    return statistics.fmean(len(s) for s in samples)


def _prefill_ms(engine, n: int) -> float:
    """Best of two full prefills of ``n`` random ids."""
    from ragblend.bench.shapes import random_ids

    ids = random_ids(random.Random(1), n, int(engine.model.config.vocab_size))
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        engine.full_prefill(ids)
        best = min(best, (time.perf_counter() - t0) * 1000)
    return best


def _redis_bandwidth(url: str, nbytes: int = 16 << 20) -> float:
    """Bytes/s of reading one ``nbytes`` value back from the Redis server at ``url``."""
    import os

    import redis

    client = redis.Redis.from_url(url)
    key = f"ragblend:plan-bandwidth:{os.getpid()}"
    client.set(key, os.urandom(nbytes), ex=60)
    try:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            client.get(key)
            best = min(best, time.perf_counter() - t0)
    finally:
        client.delete(key)
    return nbytes / max(best, 1e-9)
