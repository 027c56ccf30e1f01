"""Which storage dtype for chunk KV? kv_dtype × (bytes/token, load ms per chunk from the disk
tier cold/warm, blend and reuse answer KL, first-token KL, agreement with full prefill).

All kv_dtypes run on the same held-out questions through one disk-tier store, interleaved per
question, scored against full prefill by the bench harness. Load time: every stored chunk entry
of each kv_dtype is read in full (every layer read, verified and decoded to the compute dtype),
cold (OS page cache dropped) then warm, dtypes interleaved per repetition. The default rule
(issue 12): the smallest kv_dtype whose blend answer KL is at most 5 % above the uncompressed
entries' (kv_dtype = compute dtype). Writes ``OUT/kv_dtype_sweep_<dtype>.json`` and ``.md``.

    python benchmarks/kv_dtype_sweep.py --dataset ../shared/data/musique_dev.json --offset 20 \
        --limit 8 --dtype float32 --out benchmarks/results/intel-amx
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ragblend import BlendConfig, BlendEngine
from ragblend.bench.datasets import load_cases
from ragblend.bench.harness import Variant, run_benchmark
from ragblend.store import DiskStore
from ragblend.store.quant import kv_bytes_per_token

BUDGET = 0.05  # blend answer KL may rise at most this much over uncompressed entries


def load_times(store: DiskStore, dtypes: list[str], repeats: int, per_dtype: int) -> dict:
    """Median ms to read one chunk entry in full, cold and warm, per kv_dtype."""
    keys: dict[str, list[str]] = {d: [] for d in dtypes}
    for key in store.keys():
        entry = store.get(key)
        if entry is not None and "compute_dtype" in entry.meta:  # packed chunk entries only
            keys.setdefault(entry.meta["kv_dtype"], []).append(key)
    times = {d: {"cold": [], "warm": []} for d in dtypes}
    for rep in range(repeats):
        order = dtypes[rep % len(dtypes) :] + dtypes[: rep % len(dtypes)]
        for dtype in order:
            sample = keys[dtype][:per_dtype]
            for state in ("cold", "warm"):
                if state == "cold":
                    store.drop_page_cache()
                t0 = time.perf_counter()
                for key in sample:
                    entry = store.get(key)
                    assert entry is not None
                    for i in range(entry.num_layers):
                        entry.layer(i)
                times[dtype][state].append((time.perf_counter() - t0) * 1000 / len(sample))
    return {
        d: {f"load_ms_{s}": statistics.median(v) for s, v in t.items()} | {"chunks": len(keys[d])}
        for d, t in times.items()
    }


def int8_scheme_errors(engine: BlendEngine, cases, chunks: int = 4) -> dict:
    """Relative error ||x - dequant(quant(x))|| / ||x|| of the embedded model's real pre-RoPE
    K and V, for int8 scales per channel (over tokens) vs per token (over channels)."""
    from ragblend.store.quant import quantize_int8

    errors: dict[str, list[float]] = {}
    texts = [c for case in cases for c in case.chunks][:chunks]
    for text in texts:
        ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        kv = engine.chunks.compute_kv(ids, [])
        for name, x in (("k", kv.k.float()), ("v", kv.v.float())):
            for scheme, dim in (("per_channel", -2), ("per_token", -1)):
                q, scale = quantize_int8(x, dim)
                err = ((q.float() * scale - x).norm() / x.norm()).item()
                errors.setdefault(f"{name}_{scheme}", []).append(err)
    return {k: statistics.fmean(v) for k, v in errors.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--offset", type=int, default=20)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="float32", help="compute dtype")
    ap.add_argument("--kv-dtypes", default="float32,bfloat16,float16,int8")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--modes", default="blend,reuse", help="modes per kv_dtype (blend first)")
    ap.add_argument("--load-repeats", type=int, default=5)
    ap.add_argument(
        "--schemes",
        action="store_true",
        help="only compare int8 scale layouts on real chunk KV (no benchmark)",
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dtypes = [d.strip() for d in args.kv_dtypes.split(",") if d.strip()]

    store = DiskStore(tempfile.mkdtemp(prefix="ragblend-kvsweep-"), 1 << 40, fsync=False)
    engine = BlendEngine.from_pretrained(
        "embedded", config=BlendConfig(dtype=args.dtype), store=store
    )
    cases = load_cases(
        args.dataset, engine.tokenizer, args.top_k, args.chunk_tokens, args.offset + args.limit
    )[args.offset :]
    if args.schemes:
        errors = int8_scheme_errors(engine, cases)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kv_int8_schemes.json").write_text(
            json.dumps(
                {
                    "relative_error": errors,
                    "chunks": 4,
                    "chunk_tokens": args.chunk_tokens,
                    "dtype": args.dtype,
                },
                indent=2,
            )
        )
        print(json.dumps(errors, indent=2))
        return
    variants = [Variant("full", "full")]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for d in dtypes:
        for mode in modes:
            variants.append(Variant(f"{d} {mode}", mode, {"kv_dtype": d}))
    results = run_benchmark(engine, cases, variants, 1, args.max_new_tokens)
    loads = load_times(store, dtypes, args.load_repeats, per_dtype=12)
    lay = engine.layers
    uncompressed = str(lay.dtype).removeprefix("torch.")
    table = {}
    for d in dtypes:
        blend = results["modes"][f"{d} blend"]
        reuse = results["modes"].get(f"{d} reuse", dict.fromkeys(blend, float("nan")))
        table[d] = {
            "bytes_per_token": kv_bytes_per_token(
                d, lay.num_layers, lay.num_kv_heads, lay.head_dim, args.chunk_tokens
            ),
            **loads[d],
            "blend_answer_kl": blend["answer_kl_mean"],
            "blend_first_token_kl": blend["first_token_kl_mean"],
            "blend_agreement": blend["agreement_with_full"],
            "reuse_answer_kl": reuse["answer_kl_mean"],
            "reuse_first_token_kl": reuse["first_token_kl_mean"],
            "reuse_agreement": reuse["agreement_with_full"],
        }
    base = table.get(uncompressed, {}).get("blend_answer_kl")
    for row in table.values():
        row["blend_answer_kl_vs_uncompressed"] = row["blend_answer_kl"] / base if base else None
    within = [
        d
        for d in dtypes
        if table[d]["blend_answer_kl_vs_uncompressed"] is not None
        and table[d]["blend_answer_kl_vs_uncompressed"] <= 1 + BUDGET
    ]
    chosen = min(within, key=lambda d: table[d]["bytes_per_token"]) if within else uncompressed
    results["table"] = table
    results["chosen_default"] = chosen
    results["settings"] = {
        **vars(args),
        "n": len(cases),
        "ratio": engine.config.ratio,
        "uncompressed": uncompressed,
        "budget": BUDGET,
        "tier": "disk",
        "torch_threads": torch.get_num_threads(),
        "machine": "2 shared CPU cores (timings noisy)",
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"kv_dtype_sweep_{args.dtype}"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"kv_dtype sweep, compute dtype {args.dtype}, {len(cases)} held-out questions "
        f"(offset {args.offset}), top-{args.top_k} x {args.chunk_tokens} tokens, disk tier",
        "",
        "| kv_dtype | B/token | load ms/chunk cold | warm | blend ans KL | vs uncompr. "
        "| blend 1st KL | blend agree | reuse ans KL | reuse agree |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d, r in table.items():
        lines.append(
            f"| {d} | {r['bytes_per_token']:,.0f} | {r['load_ms_cold']:.2f} | "
            f"{r['load_ms_warm']:.2f} | {r['blend_answer_kl']:.4f} | "
            f"{r['blend_answer_kl_vs_uncompressed']:.3f} | {r['blend_first_token_kl']:.4f} | "
            f"{r['blend_agreement']:.2f} | {r['reuse_answer_kl']:.4f} | "
            f"{r['reuse_agreement']:.2f} |"
        )
    lines += [
        "",
        f"Chosen default (smallest within +{BUDGET:.0%} blend answer KL of "
        f"{uncompressed}): **{chosen}**",
    ]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
