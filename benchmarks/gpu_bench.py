"""TTFT of full / prefix / reuse / blend on 7B-8B-shaped models (random weights), for a GPU.

Builds Mistral-7B-v0.2- and Llama-3-8B-shaped models from their configs with random weights
(nothing is downloaded; weights are created on the device directly) and drives the engine with
random token ids, so no tokenizer or dataset is needed. Quality is meaningless with random
weights; this script measures time only.

What it measures, per model shape:

* TTFT per mode / recompute ratio / KV tier for chunk layouts (default 6×512, 12×512, 6×1024
  tokens plus a ~32-token question): full, prefix, reuse, blend at 0.05/0.10/0.15/0.20 and
  blend with ``ratio="auto"`` (loading controller). Tiers: ``ram`` (host memory, pinned on CUDA),
  ``disk`` (disk tier, OS page cache dropped before each cold measurement), optionally
  ``device`` (KV resident in GPU memory). Medians over ``--repeats`` interleaved rounds, with
  ``torch.cuda.synchronize()`` around each call on CUDA.
* The loading controller's decisions (``LoadingController.for_engine(...).decide(n)``) per tier.
* A request-rate sweep (paper Fig. 14): Poisson arrivals at several rates, one FIFO server doing
  one prefill at a time on a simulated clock (arrivals drawn up front, every prefill actually run
  and timed; TTFT = queueing delay + the measured prefill), mean TTFT vs rate for full and blend,
  and the throughput each sustains at equal mean TTFT.

Once per run: an attention micro-benchmark of the fusor's selected-rows attention (SDPA with
additive masks in position-ordered blocks, ``ragblend/fusion/attention.py``) against
FlexAttention with a block mask (CUDA only; skipped cleanly elsewhere).

Writes ``OUT/results.json``, ``OUT/ttft_<shape>.png`` and ``OUT/rate_<shape>.png``.

    python benchmarks/gpu_bench.py --device cuda --shape mistral-7b --out out/gpu/mistral
    OMP_NUM_THREADS=1 python benchmarks/gpu_bench.py --device cpu --shape tiny --out /tmp/gb
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ragblend.bench.harness import mean, median, sync
from ragblend.config import BlendConfig
from ragblend.engine import BlendEngine
from ragblend.prompt import TokenizedPrompt
from ragblend.store import make_store
from ragblend.store.base import ChunkKV
from ragblend.store.memory import MemoryStore

# ---------------------------------------------------------------------- model shapes
SHAPES: dict[str, dict] = {
    "mistral-7b": dict(  # Mistral-7B-v0.2 (no sliding window, rope theta 1e6)
        family="mistral",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        rope_theta=1e6,
        sliding_window=None,
        max_position_embeddings=32768,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    ),
    "llama3-8b": dict(  # Llama-3-8B
        family="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=128001,
        tie_word_embeddings=False,
    ),
    "tiny": dict(  # Mistral-shaped smoke-test model (runs on a CPU in seconds)
        family="mistral",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        rope_theta=1e6,
        sliding_window=None,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    ),
}

# Defaults that depend on whether the run is a real one or the tiny smoke test.
FULL_DEFAULTS = dict(
    layouts="6x512,12x512,6x1024",
    head_tokens=48,
    question_tokens=32,
    rate_requests=40,
    num_rates=8,
    attn_keys="3072,6144",
)
TINY_DEFAULTS = dict(
    layouts="3x48,2x96",
    head_tokens=16,
    question_tokens=8,
    rate_requests=4,
    num_rates=3,
    attn_keys="256",
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class IdTokenizer:
    """Stands in for a tokenizer: the engine is driven with token ids only."""

    bos_token_id = None
    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(i) for i in ids)


def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int):
    """A random-weight model of the given shape, created on ``device`` directly."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

    spec = dict(SHAPES[shape])
    family = spec.pop("family")
    cls = {"mistral": MistralConfig, "llama": LlamaConfig}[family]
    config = cls(**spec)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if next(model.parameters()).device != device:  # older transformers ignore the context
        model.to(device)
    return model.eval()


# ---------------------------------------------------------------------- helpers
def percentile(xs, q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(s[lo] + (s[hi] - s[lo]) * (pos - lo))


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        k, n = part.lower().strip().split("x")
        out.append((int(k), int(n)))
    return out


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    hi = min(vocab, 128000)  # stay below Llama-3's special tokens
    lo = min(100, hi // 4)
    return [rng.randrange(lo, hi) for _ in range(n)]


def environment(device: torch.device) -> dict:
    import transformers

    env = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "device": str(device),
    }
    try:
        env["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=torch.cuda.get_device_name(device),
            capability=".".join(map(str, torch.cuda.get_device_capability(device))),
            device_memory_bytes=int(props.total_memory),
            cudnn=torch.backends.cudnn.version(),
        )
    else:
        env["device_name"] = platform.processor() or platform.machine()
    smi = nvidia_smi()
    if smi is not None:
        env["nvidia_smi"] = smi
    return env


def nvidia_smi() -> str | None:
    """Name, driver, clocks, power and temperature from ``nvidia-smi`` (None without it)."""
    if not shutil.which("nvidia-smi"):
        return None
    query = (
        "name,driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,"
        "power.draw,power.limit,temperature.gpu,memory.total,persistence_mode"
    )
    try:
        res = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return res.stdout.strip() or res.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"failed: {exc}"


def filesystem_of(path: Path) -> str | None:
    """Filesystem type of ``path`` from /proc/mounts (tmpfs means the disk tier is RAM)."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    best, kind = "", None
    target = str(path.resolve())
    for line in mounts:
        parts = line.split()
        if (
            len(parts) >= 3
            and (
                target == parts[1]
                or target.startswith(parts[1].rstrip("/") + "/")
                or parts[1] == "/"
            )
            and len(parts[1]) >= len(best)
        ):
            best, kind = parts[1], parts[2]
    return kind


# ---------------------------------------------------------------------- stores and views
def pinned(t: torch.Tensor, pin: bool) -> torch.Tensor:
    t = t.detach().to("cpu").contiguous()
    return t.pin_memory() if pin else t


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
    stores = {}
    keys = master.keys()
    for tier in tiers:
        if tier == "device":
            stores[tier] = master
        elif tier == "ram":
            ram = MemoryStore(1 << 40)
            if ram_prefetch:  # read by the engine: pipelined loading (CUDA side stream)
                ram.prefetch_depth = ram_prefetch
            for key in keys:
                kv = master.get(key)
                pin = device.type == "cuda"
                ram.put(key, ChunkKV(pinned(kv.k, pin), pinned(kv.v, pin), dict(kv.meta)))
            stores[tier] = ram
        elif tier == "disk":
            disk = make_store("disk", path=store_root / "kv", disk_bytes=1 << 40)
            for key in keys:
                disk.put(key, master.get(key))
            stores[tier] = disk
        else:
            raise SystemExit(f"gpu_bench.py: error: unknown tier {tier!r} (ram, disk, device)")
    return stores


def view_for(engine: BlendEngine, store, controller=None) -> BlendEngine:
    return engine.with_config(store=store, controller=controller)


@dataclass
class Variant:
    name: str
    mode: str
    tier: str | None
    ratio: float | str | None = None


def make_variants(modes: list[str], ratios: list[float], tiers: list[str], auto: bool):
    out = []
    if "full" in modes:
        out.append(Variant("full", "full", None))
    for tier in tiers:
        if "prefix" in modes:
            out.append(Variant(f"prefix [{tier}]", "prefix", tier))
        if "reuse" in modes:
            out.append(Variant(f"reuse [{tier}]", "reuse", tier))
        if "blend" in modes:
            for r in ratios:
                out.append(Variant(f"blend r={r:g} [{tier}]", "blend", tier, r))
            if auto:
                out.append(Variant(f"blend auto [{tier}]", "blend", tier, "auto"))
    return out


def timed_prefill(view: BlendEngine, prompt: TokenizedPrompt, mode: str, ratio, device):
    """(TTFT ms, stats, logits finite) of one prefill, synchronised on CUDA; cache freed."""
    drop = getattr(view.store, "drop_page_cache", None)
    if drop is not None and mode != "full":
        drop()  # cold read from the disk tier
    sync(device)
    t0 = time.perf_counter()
    pre = view.prefill(prompt, mode, ratio)
    sync(device)
    ms = (time.perf_counter() - t0) * 1000
    stats = pre.stats
    finite = bool(torch.isfinite(pre.logits).all())
    del pre
    return ms, stats, finite


# ---------------------------------------------------------------------- TTFT sweep
def layout_sweep(engine, views, prompt, variants, repeats, warmup, device) -> dict:
    """Interleaved TTFT measurements of every variant on one prompt."""
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    last: dict[str, dict] = {}
    for rep in range(warmup + repeats):
        for v in variants:
            view = views[v.tier] if v.tier else engine
            ms, stats, finite = timed_prefill(view, prompt, v.mode, v.ratio, device)
            if rep >= warmup:
                times[v.name].append(ms)
            last[v.name] = {"stats": stats, "finite": finite}
    full = median(times["full"]) if "full" in times else float("nan")
    out = {}
    for v in variants:
        st = last[v.name]["stats"]
        med = median(times[v.name])
        controller = st.extra.get("controller")
        out[v.name] = {
            "mode": v.mode,
            "tier": v.tier,
            "ratio": v.ratio,
            "ttft_ms_median": med,
            "ttft_ms_min": min(times[v.name]),
            "ttft_ms_all": times[v.name],
            "speedup_vs_full": full / med if med else float("nan"),
            "load_ms_last": st.load_ms,
            "recomputed_fraction": st.recomputed_fraction,
            "effective_ratio": st.ratio,
            "chunk_hits": st.chunk_hits,
            "chunk_misses": st.chunk_misses,
            "logits_finite": last[v.name]["finite"],
            "controller": controller,
        }
    return out


# ---------------------------------------------------------------------- request-rate sweep
def simulate_fifo(view, requests, arrivals, mode, ratio, device) -> dict:
    """One FIFO server on a simulated clock; every prefill is actually run and timed."""
    free_at = 0.0
    ttfts, services, waits = [], [], []
    for prompt, arrival in zip(requests, arrivals):
        start = max(arrival, free_at)
        ms, _, _ = timed_prefill(view, prompt, mode, ratio, device)
        free_at = start + ms / 1000
        waits.append((start - arrival) * 1000)
        services.append(ms)
        ttfts.append((free_at - arrival) * 1000)
    makespan = free_at - arrivals[0] if arrivals else 0.0
    return {
        "mean_ttft_ms": mean(ttfts),
        "p50_ttft_ms": percentile(ttfts, 0.5),
        "p90_ttft_ms": percentile(ttfts, 0.9),
        "mean_queue_ms": mean(waits),
        "mean_service_ms": mean(services),
        "utilization": (sum(services) / 1000 / makespan) if makespan > 0 else float("nan"),
    }


def max_rate_at(rates: list[float], ttfts: list[float], target: float) -> dict:
    """Largest rate whose mean TTFT stays ≤ target (linear interpolation at the crossing)."""
    pairs = sorted(zip(rates, ttfts))
    if not pairs or pairs[0][1] > target:
        return {"rate": 0.0 if pairs else None, "bound": "below_lowest_rate"}
    best = pairs[0][0]
    for (r0, t0), (r1, t1) in zip(pairs, pairs[1:]):
        if t1 > target:
            frac = (target - t0) / (t1 - t0) if t1 != t0 else 0.0
            return {"rate": r0 + frac * (r1 - r0), "bound": "interpolated"}
        best = r1
    return {"rate": best, "bound": "at_least"}  # every measured rate met the target


def rate_sweep(engine, view, pool, k, head, sep, args, vocab, device) -> dict:
    rng = random.Random(args.seed + 1)
    n = args.rate_requests
    requests = []
    for _ in range(n):
        chunks = [pool[i] for i in rng.sample(range(len(pool)), k)]
        requests.append(
            TokenizedPrompt(head, chunks, sep, random_ids(rng, args.question_tokens, vocab))
        )
    ratio = args.rate_ratio
    # Warm up both modes, then calibrate each mode's unloaded service time.
    for mode, r in (("full", None), ("blend", ratio)):
        timed_prefill(view if mode == "blend" else engine, requests[0], mode, r, device)
    calib = {}
    for mode, r in (("full", None), ("blend", ratio)):
        who = view if mode == "blend" else engine
        calib[mode] = median(
            [timed_prefill(who, p, mode, r, device)[0] for p in requests[: min(n, 5)]]
        )
    if args.rates == "auto":
        lo = 0.3 * 1000 / calib["full"]
        hi = max(1.2 * 1000 / min(calib.values()), 4 * lo)
        count = max(2, args.num_rates)
        rates = [lo * (hi / lo) ** (i / (count - 1)) for i in range(count)]
    else:
        rates = floats(args.rates)
    curves: dict[str, list[dict]] = {"full": [], "blend": []}
    for i, rate in enumerate(rates):
        arng = random.Random(args.seed * 1000 + i)
        t, arrivals = 0.0, []
        for _ in range(n):
            t += arng.expovariate(rate)
            arrivals.append(t)
        for mode, r in (("full", None), ("blend", ratio)):
            who = view if mode == "blend" else engine
            point = simulate_fifo(who, requests, arrivals, mode, r, device)
            curves[mode].append({"rate": rate, **point})
    targets = (
        floats(args.ttft_targets_ms)
        if args.ttft_targets_ms
        else [m * calib["full"] for m in (1.5, 2.0, 4.0)]
    )
    equal = []
    for target in targets:
        row = {"target_mean_ttft_ms": target}
        for mode in ("full", "blend"):
            row[mode] = max_rate_at(rates, [p["mean_ttft_ms"] for p in curves[mode]], target)
        f, b = row["full"]["rate"], row["blend"]["rate"]
        row["throughput_ratio_blend_over_full"] = (b / f) if f else None
        equal.append(row)
    return {
        "ratio": ratio,
        "chunks_per_request": k,
        "pool_chunks": len(pool),
        "requests_per_rate": n,
        "unloaded_service_ms": calib,
        "rates": rates,
        "curves": curves,
        "throughput_at_equal_mean_ttft": equal,
    }


# ---------------------------------------------------------------------- attention micro-bench
def _bench(fn, device, iters: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1000)
    return median(times)


def attention_bench(args, device, dtype, heads, kv_heads, dim) -> dict:
    """Selected-rows attention: the fusor's blocked SDPA vs FlexAttention (CUDA only)."""
    gen = torch.Generator().manual_seed(args.seed)
    flex_note, flex = None, None
    if device.type == "cuda":
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = (torch.compile(flex_attention, dynamic=False), create_block_mask)
        except Exception as exc:  # report and go on without FlexAttention
            flex_note = f"unavailable: {type(exc).__name__}: {exc}"
    else:
        flex_note = "skipped: FlexAttention is measured on CUDA only (it needs torch.compile)"
    cases = [
        attention_case(n, args, device, dtype, heads, kv_heads, dim, gen, flex)
        for n in ints(args.attn_keys)
    ]
    return {"flex": flex_note or "measured", "ratio": args.attn_ratio, "cases": cases}


def attention_case(n_keys, args, device, dtype, heads, kv_heads, dim, gen, flex) -> dict:
    import torch.nn.functional as F

    from ragblend.fusion.attention import RowAttentionPlan, attend_rows, position_mask

    groups = heads // kv_heads
    scaling = dim**-0.5
    m = max(2, round(args.attn_ratio * n_keys))
    chosen = torch.randperm(n_keys - 1, generator=gen)[: m - 1].sort().values
    pos = torch.cat([chosen, torch.tensor([n_keys - 1])]).to(device)
    q = torch.randn(1, heads, m, dim, generator=gen).to(device, dtype)
    k = torch.randn(1, kv_heads, n_keys, dim, generator=gen).to(device, dtype)
    v = torch.randn(1, kv_heads, n_keys, dim, generator=gen).to(device, dtype)
    case = {
        "keys": n_keys,
        "rows": m,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": dim,
        "dtype": str(dtype).replace("torch.", ""),
    }
    # Reference: dense fp32 attention with the exact position mask.
    kf = k.float().repeat_interleave(groups, dim=1)
    vf = v.float().repeat_interleave(groups, dim=1)
    ref = F.scaled_dot_product_attention(
        q.float(), kf, vf, attn_mask=position_mask(pos, n_keys), scale=scaling
    )
    ref = ref.transpose(1, 2).reshape(1, m, heads * dim)
    del kf, vf
    # The fusor's path: a plan (built once per selection) + blocked SDPA (on every layer).
    iters = args.attn_iters
    case["sdpa_blocks_plan_ms"] = _bench(
        lambda: RowAttentionPlan(pos, groups, dtype, None), device, iters
    )
    plan = RowAttentionPlan(pos, groups, dtype, None)
    case["sdpa_blocks_blocks"] = len(plan.blocks)
    case["sdpa_blocks_ms"] = _bench(lambda: attend_rows(q, k, v, plan, scaling), device, iters)
    out = attend_rows(q, k, v, plan, scaling)
    case["sdpa_blocks_max_abs_err"] = float((out.float() - ref).abs().max())
    # Context: full causal self-attention of all N rows (what a full prefill pays per layer).
    qn = torch.randn(1, heads, n_keys, dim, generator=gen).to(device, dtype)
    case["full_causal_sdpa_ms"] = _bench(
        lambda: F.scaled_dot_product_attention(
            qn, k, v, is_causal=True, scale=scaling, enable_gqa=True
        ),
        device,
        iters,
    )
    if flex is None:
        return case
    flex_attention, create_block_mask = flex

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= pos[q_idx]

    def block_mask():
        return create_block_mask(mask_mod, None, None, m, n_keys, device=device)

    try:
        t0 = time.perf_counter()
        bm = block_mask()
        fq = flex_attention(q, k, v, block_mask=bm, scale=scaling, enable_gqa=True)
        sync(device)
        case["flex_first_call_s"] = time.perf_counter() - t0  # includes compilation
        case["flex_block_mask_ms"] = _bench(block_mask, device, iters)
        case["flex_ms"] = _bench(
            lambda: flex_attention(q, k, v, block_mask=bm, scale=scaling, enable_gqa=True),
            device,
            iters,
        )
        fo = fq.transpose(1, 2).reshape(1, m, heads * dim)
        case["flex_max_abs_err"] = float((fo.float() - ref).abs().max())
        case["flex_speedup_vs_sdpa_blocks"] = case["sdpa_blocks_ms"] / case["flex_ms"]
    except Exception as exc:  # keep the rest of the run
        case["flex_error"] = f"{type(exc).__name__}: {exc}"
    return case


# ---------------------------------------------------------------------- one model shape
def run_shape(shape: str, args, device, dtype, out: Path) -> dict:
    from ragblend.controller import LoadingController

    t0 = time.perf_counter()
    model = build_model(shape, device, dtype, args.seed)
    sync(device)
    build_s = time.perf_counter() - t0
    cfg = model.config
    vocab = int(cfg.vocab_size)
    master = MemoryStore(1 << 40)
    engine = BlendEngine(
        model,
        IdTokenizer(),
        # Driven with token ids only (no chat template): chunks are keyed by the given head.
        BlendConfig(device=str(device), dtype=args.dtype, precompute_context="prefix"),
        store=master,
        name=f"{shape} (random weights)",
    )
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

        views = {t: view_for(engine, stores[t], controllers.get(t)) for t in stores}
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        variants = make_variants(modes, floats(args.ratios), tiers, not args.no_auto)
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
    if device.type == "cuda":
        info["max_memory_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return info


# ---------------------------------------------------------------------- output
def print_layout(shape: str, name: str, n_tokens: int, res: dict) -> None:
    print(f"\n[{shape}] layout {name} ({n_tokens} prompt tokens)", flush=True)
    print(f"  {'variant':<26}{'TTFT ms':>10}{'speedup':>9}{'recomp':>8}{'load ms':>9}")
    for vname, r in res.items():
        print(
            f"  {vname:<26}{r['ttft_ms_median']:>10.1f}{r['speedup_vs_full']:>9.2f}"
            f"{r['recomputed_fraction']:>8.3f}{r['load_ms_last']:>9.1f}"
        )


def print_rates(shape: str, rs: dict) -> None:
    print(
        f"\n[{shape}] request-rate sweep ({rs['layout']}, {rs['tier']} tier, blend "
        f"r={rs['ratio']}, {rs['requests_per_rate']} requests/rate)",
        flush=True,
    )
    print(f"  {'rate/s':>8}{'full mean TTFT':>16}{'blend mean TTFT':>17}")
    for f, b in zip(rs["curves"]["full"], rs["curves"]["blend"]):
        print(f"  {f['rate']:>8.2f}{f['mean_ttft_ms']:>16.1f}{b['mean_ttft_ms']:>17.1f}")
    for row in rs["throughput_at_equal_mean_ttft"]:
        ratio = row["throughput_ratio_blend_over_full"]
        print(
            f"  at mean TTFT ≤ {row['target_mean_ttft_ms']:.0f} ms: full "
            f"{row['full']['rate']:.2f}/s, blend {row['blend']['rate']:.2f}/s"
            + (f" ({ratio:.2f}×)" if ratio else "")
        )


def plot_shape(info: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shape = info["shape"]
    layouts = info.get("layouts", {})
    if layouts:
        fig, axes = plt.subplots(1, len(layouts), figsize=(5.5 * len(layouts), 4.5), squeeze=False)
        for ax, (name, lay) in zip(axes[0], layouts.items()):
            res = lay["variants"]
            tiers = sorted({r["tier"] for r in res.values() if r["tier"]})
            for i, tier in enumerate(tiers):
                color = f"C{i}"
                pts = sorted(
                    (r["ratio"], r["ttft_ms_median"])
                    for r in res.values()
                    if r["tier"] == tier and r["mode"] == "blend" and isinstance(r["ratio"], float)
                )
                reuse = [
                    r["ttft_ms_median"]
                    for r in res.values()
                    if r["tier"] == tier and r["mode"] == "reuse"
                ]
                xs = ([0.0] if reuse else []) + [p[0] for p in pts]
                ys = reuse + [p[1] for p in pts]
                ax.plot(xs, ys, "o-", color=color, label=f"reuse→blend [{tier}]")
                for r in res.values():
                    if r["tier"] == tier and r["mode"] == "prefix":
                        ax.axhline(
                            r["ttft_ms_median"], color=color, ls=":", label=f"prefix [{tier}]"
                        )
                    if r["tier"] == tier and r["ratio"] == "auto":
                        x = r["effective_ratio"] or 1.0
                        ax.scatter(
                            [x],
                            [r["ttft_ms_median"]],
                            marker="*",
                            s=120,
                            color=color,
                            label=f"blend auto [{tier}]",
                        )
            if "full" in res:
                ax.axhline(res["full"]["ttft_ms_median"], color="k", ls="--", label="full")
            ax.set(
                title=f"{shape} · {name} ({lay['prompt_tokens']} tok)",
                xlabel="recompute ratio (0 = reuse)",
                ylabel="TTFT median (ms)",
            )
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"ttft_{shape}.png", dpi=120)
        plt.close(fig)
    rs = info.get("rate_sweep")
    if rs:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for mode, style in (("full", "s--"), ("blend", "o-")):
            pts = rs["curves"][mode]
            label = mode if mode == "full" else f"blend r={rs['ratio']}"
            ax.plot([p["rate"] for p in pts], [p["mean_ttft_ms"] for p in pts], style, label=label)
        for row in rs["throughput_at_equal_mean_ttft"]:
            ax.axhline(row["target_mean_ttft_ms"], color="grey", ls=":", lw=0.8)
        ax.set(
            xlabel="request rate (requests/s, Poisson)",
            ylabel="mean TTFT (ms)",
            title=f"{shape} · {rs['layout']} · {rs['tier']} tier · FIFO",
            xscale="log",
            yscale="log",
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"rate_{shape}.png", dpi=120)
        plt.close(fig)


# ---------------------------------------------------------------------- CLI
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument(
        "--shape",
        default="mistral-7b",
        help=f"comma-separated model shapes: {', '.join(SHAPES)} (default mistral-7b)",
    )
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES), help="default bfloat16")
    ap.add_argument(
        "--layouts",
        default=None,
        help=f"chunks x tokens, comma-separated (default {FULL_DEFAULTS['layouts']}; "
        f"tiny: {TINY_DEFAULTS['layouts']})",
    )
    ap.add_argument(
        "--head-tokens",
        type=int,
        default=None,
        help="prompt head (BOS + template/system prompt) tokens (default 48; tiny: 16)",
    )
    ap.add_argument("--question-tokens", type=int, default=None, help="default 32; tiny: 8")
    ap.add_argument("--separator-tokens", type=int, default=1, help="between chunks (default 1)")
    ap.add_argument("--modes", default="full,prefix,reuse,blend", help="default: all four")
    ap.add_argument(
        "--ratios",
        default="0.05,0.1,0.15,0.2",
        help="blend recompute ratios (default 0.05,0.1,0.15,0.2)",
    )
    ap.add_argument("--no-auto", action="store_true", help="skip blend with ratio='auto'")
    ap.add_argument(
        "--tiers", default="ram,disk", help="KV tiers: ram, disk, device (default ram,disk)"
    )
    ap.add_argument(
        "--ram-prefetch",
        type=int,
        default=0,
        help="layers the RAM tier loads ahead (0: the engine's default for RAM, "
        "no pipelining; >0: pipelined like the disk tier)",
    )
    ap.add_argument(
        "--store-path",
        default=None,
        help="parent directory of the temporary disk tier (use a real disk, not "
        "tmpfs); default: the system temp dir",
    )
    ap.add_argument("--keep-store", action="store_true", help="do not delete the disk tier")
    ap.add_argument(
        "--repeats", type=int, default=5, help="interleaved measured rounds (default 5)"
    )
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    ap.add_argument("--skip-rates", action="store_true", help="skip the request-rate sweep")
    ap.add_argument(
        "--rate-layout", default=None, help="layout of the rate sweep (default: the first layout)"
    )
    ap.add_argument(
        "--rate-pool",
        type=int,
        default=None,
        help="distinct chunks requests draw from (default 2 × chunks/request)",
    )
    ap.add_argument(
        "--rate-requests", type=int, default=None, help="requests per rate (default 40; tiny: 4)"
    )
    ap.add_argument(
        "--rates",
        default="auto",
        help="requests/s, comma-separated, or 'auto' (0.3× full's capacity to "
        "1.2× blend's, geometric)",
    )
    ap.add_argument(
        "--num-rates", type=int, default=None, help="rates when --rates auto (default 8; tiny: 3)"
    )
    ap.add_argument(
        "--rate-ratio", type=float, default=0.15, help="blend ratio in the sweep (default 0.15)"
    )
    ap.add_argument(
        "--rate-tier",
        default="ram",
        choices=("ram", "disk", "device"),
        help="KV tier of the rate sweep (default ram)",
    )
    ap.add_argument(
        "--ttft-targets-ms",
        default=None,
        help="mean-TTFT targets for throughput at equal TTFT (default: 1.5, 2, 4 × "
        "full's unloaded TTFT)",
    )
    ap.add_argument(
        "--skip-attention", action="store_true", help="skip the attention micro-benchmark"
    )
    ap.add_argument("--attn-keys", default=None, help="key counts N (default 3072,6144; tiny: 256)")
    ap.add_argument(
        "--attn-ratio", type=float, default=0.15, help="selected rows m = ratio·N (default 0.15)"
    )
    ap.add_argument("--attn-iters", type=int, default=20, help="timed calls (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default="out/gpu_bench", help="output directory (default out/gpu_bench)"
    )
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shape.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; expected some of {', '.join(SHAPES)}")
    args.shapes = shapes
    defaults = TINY_DEFAULTS if shapes == ["tiny"] else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def resolve_device(name: str) -> torch.device:
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit(
                f"gpu_bench.py: error: --device {name} requested but CUDA is not available "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
                "run on a GPU machine or use --device cpu --shape tiny for a smoke test"
            )
        device = torch.device(name)
        return torch.device(
            "cuda", torch.cuda.current_device() if device.index is None else device.index
        )
    if name != "cpu":
        raise SystemExit(f"gpu_bench.py: error: unknown device {name!r} (cuda, cuda:N, cpu)")
    return torch.device("cpu")


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = DTYPES[args.dtype]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "environment": environment(device),
        "settings": {k: v for k, v in vars(args).items() if k != "shapes"},
        "models": {},
    }
    if argv is not None:
        results["environment"]["argv"] = ["gpu_bench.py", *argv]
        results["environment"]["command"] = shlex.join(["benchmarks/gpu_bench.py", *argv])
    print(
        f"gpu_bench on {results['environment'].get('device_name')} ({device}), "
        f"torch {torch.__version__}",
        flush=True,
    )
    for shape in args.shapes:
        results["models"][shape] = run_shape(shape, args, device, dtype, out)
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    if not args.skip_attention:
        spec = SHAPES[args.shapes[0]]
        heads, kv_heads = spec["num_attention_heads"], spec["num_key_value_heads"]
        results["attention"] = attention_bench(
            args, device, dtype, heads, kv_heads, spec["hidden_size"] // heads
        )
        print("\nselected-rows attention (ms):")
        for c in results["attention"]["cases"]:
            flex = c.get("flex_ms", c.get("flex_error", results["attention"]["flex"]))
            print(
                f"  N={c['keys']} m={c['rows']}: sdpa_blocks {c['sdpa_blocks_ms']:.3f} "
                f"(plan {c['sdpa_blocks_plan_ms']:.3f}, err {c['sdpa_blocks_max_abs_err']:.1e})"
                f", full causal {c['full_causal_sdpa_ms']:.3f}, flex {flex}"
            )
    smi = nvidia_smi()
    if smi is not None:  # clocks right after the load (the first reading is usually idle)
        results["environment"]["nvidia_smi_after"] = smi
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {out / 'results.json'} and {', '.join(p.name for p in out.glob('*.png'))}")
    return results


if __name__ == "__main__":
    main()
