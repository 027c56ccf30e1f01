"""``benchmarks/gpu_bench.py``'s timing: interleaved TTFT per variant, request rates, attention.

Every prefill is timed with the device synchronised before and after (``sync``), so CUDA's
asynchronous kernels are inside the clock.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from ragblend.bench.harness import mean, median, percentile, sync
from ragblend.bench.shapes import random_ids
from ragblend.engine import BlendEngine
from ragblend.prompt import TokenizedPrompt


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


@dataclass
class Variant:
    """One timed configuration: a mode, the KV tier it reads (None: full), a ratio, and the
    layer steps it runs (``BlendConfig.layer_kernels``; None: the engine's)."""

    name: str
    mode: str
    tier: str | None
    ratio: float | str | None = None
    layer_kernels: str | None = None


def make_variants(
    modes: list[str], ratios: list[float], tiers: list[str], auto: bool, fused: bool = False
):
    """The timed variants; ``fused``: also reuse and blend at the main ratio (0.15, else the
    first) with ``layer_kernels="fused"``, timed in the same rounds as the others."""
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
        if fused and "reuse" in modes:
            out.append(Variant(f"reuse [{tier}] fused", "reuse", tier, None, "fused"))
        if fused and "blend" in modes and ratios:
            r = 0.15 if 0.15 in ratios else ratios[0]
            out.append(Variant(f"blend r={r:g} [{tier}] fused", "blend", tier, r, "fused"))
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


def layout_sweep(engine, views, prompt, variants, repeats, warmup, device) -> dict:
    """Interleaved TTFT measurements of every variant on one prompt (``views``: per tier, and
    per ``(tier, layer_kernels)`` for the variants that set them)."""
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    last: dict[str, dict] = {}
    for rep in range(warmup + repeats):
        for v in variants:
            key = (v.tier, v.layer_kernels) if v.layer_kernels else v.tier
            view = views[key] if v.tier else engine
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
            "layer_kernels": v.layer_kernels or view_kernels(views, v),
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


def view_kernels(views: dict, v: Variant) -> str:
    """The layer steps a variant's view resolved to (``"hf"`` for HF's modules)."""
    kernels = getattr(views.get(v.tier), "layer_kernels", None) if v.tier else None
    return "hf" if kernels is None else "fused"


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
        row: dict[str, Any] = {"target_mean_ttft_ms": target}
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
