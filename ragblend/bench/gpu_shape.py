"""``benchmarks/gpu_bench.py``'s run of one model shape: build, precompute, fill tiers, time, plot.

Builds the random-weight model (``ragblend.bench.shapes``), precomputes every chunk of every
layout into a device-resident master store, copies the entries into each KV tier under test,
asks the loading controller for its decisions, then runs the interleaved TTFT sweep and the
request-rate sweep (:mod:`ragblend.bench.gpu_timing`) and draws the plots
(:mod:`ragblend.bench.gpu_report`).
"""

from __future__ import annotations

import gc
import random
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from ragblend.bench.environment import filesystem_of
from ragblend.bench.gpu_report import plot_shape, print_layout, print_rates
from ragblend.bench.gpu_timing import floats, layout_sweep, make_variants, rate_sweep
from ragblend.bench.harness import peak_memory, sync
from ragblend.bench.shapes import SHAPES, pinned, random_ids, shape_engine
from ragblend.engine import BlendEngine
from ragblend.prompt import TokenizedPrompt
from ragblend.store import make_store
from ragblend.store.base import ChunkKV, KVEntry, KVStore
from ragblend.store.memory import MemoryStore
from ragblend.store.quant import to_cpu


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        k, n = part.lower().strip().split("x")
        out.append((int(k), int(n)))
    return out


def tier_stores(
    master: MemoryStore,
    tiers: list[str],
    device: torch.device,
    store_root: Path,
    ram_prefetch: int = 0,
):
    """Copies of every entry of ``master`` (device-resident) into each requested tier.

    The RAM tier has no prefetch by default (the engine's behaviour for a MemoryStore: layers
    are copied on the compute stream); ``ram_prefetch`` > 0 gives it the disk tier's pipelined
    loader instead.
    """
    stores: dict[str, KVStore] = {}
    keys = master.keys()
    for tier in tiers:
        if tier == "device":
            stores[tier] = master
        elif tier == "ram":
            ram = MemoryStore(1 << 40)
            if ram_prefetch:  # read by the engine: pipelined loading (CUDA side stream)
                ram.prefetch_depth = ram_prefetch
            for key in keys:
                kv = _entry(master, key)
                pin = device.type == "cuda"
                if isinstance(kv, ChunkKV):
                    ram.put(key, ChunkKV(pinned(kv.k, pin), pinned(kv.v, pin), dict(kv.meta)))
                else:  # a coded entry (kv_dtype="auto" on a float32 model: int8) as stored
                    ram.put(key, to_cpu(kv))
            stores[tier] = ram
        elif tier == "disk":
            disk = make_store("disk", path=store_root / "kv", disk_bytes=1 << 40)
            for key in keys:
                disk.put(key, _entry(master, key))
            stores[tier] = disk
        else:
            raise SystemExit(f"gpu_bench.py: error: unknown tier {tier!r} (ram, disk, device)")
    return stores


def _entry(master: MemoryStore, key: str) -> KVEntry:
    kv = master.get(key)
    if kv is None:
        raise RuntimeError(f"gpu_bench.py: the master store lost entry {key!r}")
    return kv


def view_for(engine: BlendEngine, store, controller=None) -> BlendEngine:
    return engine.with_config(store=store, controller=controller)


def run_shape(shape: str, args, device, out: Path) -> dict:
    from ragblend.controller import LoadingController

    master = MemoryStore(1 << 40)
    engine, build_s = shape_engine(shape, device, args.dtype, args.seed, master)
    model = engine.model
    cfg = model.config
    vocab = int(cfg.vocab_size)
    lay = engine.layers
    info = {
        "shape": shape,
        "config": {k: v for k, v in SHAPES[shape].items()},
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": args.dtype,
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
        "kv_bytes_per_token": lay.kv_bytes_per_token(),
        "build_s": build_s,
        "blend_config": {
            "check_layers": list(engine.config.check_layers),
            "check_scales": list(engine.config.check_scales or []),
            "selector": engine.config.selector,
            "precompute_context": engine.config.precompute_context,
        },
    }
    print(
        f"[{shape}] built in {build_s:.1f}s: {info['parameters'] / 1e6:.1f}M params, "
        f"{info['kv_bytes_per_token']} KV bytes/token",
        flush=True,
    )

    rng = random.Random(args.seed)
    head = [int(cfg.bos_token_id)] + random_ids(rng, args.head_tokens - 1, vocab)
    sep = random_ids(rng, args.separator_tokens, vocab) if args.separator_tokens else []
    layouts = parse_layouts(args.layouts)
    prompts = {}
    t0 = time.perf_counter()
    for k, n in layouts:
        chunks = [random_ids(rng, n, vocab) for _ in range(k)]
        prompts[f"{k}x{n}"] = TokenizedPrompt(
            head, chunks, sep, random_ids(rng, args.question_tokens, vocab)
        )
        for c in chunks:
            engine.precompute_ids(c, head)
    rate_k, rate_n = parse_layouts(args.rate_layout)[0] if args.rate_layout else layouts[0]
    pool = []
    if not args.skip_rates:
        pool = [random_ids(rng, rate_n, vocab) for _ in range(args.rate_pool or 2 * rate_k)]
        for c in pool:
            engine.precompute_ids(c, head)
    sync(device)
    info["precompute_s"] = time.perf_counter() - t0
    print(
        f"[{shape}] precomputed {len(master)} KV entries in {info['precompute_s']:.1f}s", flush=True
    )

    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    rate_tier = args.rate_tier
    if device.type != "cuda":  # on CPU the "device" tier is the RAM tier
        tiers = [t for t in tiers if t != "device"]
        rate_tier = "ram" if rate_tier == "device" else rate_tier
    wanted = sorted(set(tiers) | (set() if args.skip_rates else {rate_tier}))
    if args.store_path:
        Path(args.store_path).mkdir(parents=True, exist_ok=True)
    store_root = Path(tempfile.mkdtemp(prefix="ragblend-gpubench-", dir=args.store_path))
    stores: dict = {}
    try:
        t0 = time.perf_counter()
        stores = tier_stores(master, wanted, device, store_root, args.ram_prefetch)
        info["store_fill_s"] = time.perf_counter() - t0
        print(
            f"[{shape}] filled tiers {', '.join(wanted)} in {info['store_fill_s']:.1f}s", flush=True
        )
        if "device" not in wanted:
            master.clear()  # the GPU copies are no longer needed
        engine = engine.with_config(store=stores[tiers[0]] if tiers else master)
        info["tiers"] = tiers
        info["store_path"] = str(store_root)
        info["store_filesystem"] = filesystem_of(store_root)
        if "disk" in stores and info["store_filesystem"] in ("tmpfs", "ramfs"):
            print(
                f"warning: the disk tier {store_root} is on {info['store_filesystem']} (RAM); "
                "pass --store-path on a real disk for cold-read numbers",
                flush=True,
            )
        if "disk" in stores:
            info["drop_page_cache_supported"] = bool(stores["disk"].drop_page_cache())

        # Loading controller, per tier (profile measured once, disk bandwidth added for disk).
        controllers, decisions = {}, {}
        for i, tier in enumerate(t for t in tiers if t in ("ram", "disk", "device")):
            probe = view_for(engine, stores[tier])
            controllers[tier] = LoadingController.for_engine(probe, refresh=(i == 0))
            decisions[tier] = {
                name: asdict(controllers[tier].decide(len(p))) for name, p in prompts.items()
            }
        if controllers:
            prof = next(iter(controllers.values())).profile
            info["controller_profile"] = {
                "prefill_ms_fixed": prof.prefill_ms_fixed,
                "prefill_ms_per_token": prof.prefill_ms_per_token,
                "bytes_per_token": prof.bytes_per_token,
                "bandwidth_bytes_per_s": {
                    t: c.profile.bandwidth.get(c.tier) for t, c in controllers.items()
                },
            }
        info["controller"] = decisions

        views: dict = {t: view_for(engine, stores[t], controllers.get(t)) for t in stores}
        if args.fused:
            views.update(
                {(t, "fused"): v.with_config(layer_kernels="fused") for t, v in list(views.items())}
            )
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        variants = make_variants(modes, floats(args.ratios), tiers, not args.no_auto, args.fused)
        info["layouts"] = {}
        for name, prompt in prompts.items():
            t0 = time.perf_counter()
            res = layout_sweep(engine, views, prompt, variants, args.repeats, args.warmup, device)
            k, n = parse_layouts(name)[0]
            info["layouts"][name] = {
                "chunks": k,
                "chunk_tokens": n,
                "prompt_tokens": len(prompt),
                "kv_bytes_loaded": k * n * lay.kv_bytes_per_token(),
                "seconds": time.perf_counter() - t0,
                "variants": res,
            }
            print_layout(shape, name, len(prompt), res)

        if not args.skip_rates:
            t0 = time.perf_counter()
            rs = rate_sweep(engine, views[rate_tier], pool, rate_k, head, sep, args, vocab, device)
            rs["layout"] = f"{rate_k}x{rate_n}"
            rs["tier"] = rate_tier
            rs["seconds"] = time.perf_counter() - t0
            info["rate_sweep"] = rs
            print_rates(shape, rs)
    finally:
        for s in stores.values():
            close = getattr(s, "close", None)
            if close is not None:
                close()
        if not args.keep_store:
            shutil.rmtree(store_root, ignore_errors=True)
    plot_shape(info, out)
    del engine, views, model, master
    gc.collect()
    peak = peak_memory(device)
    if peak is not None:
        info["max_memory_allocated_bytes"] = peak
    return info
