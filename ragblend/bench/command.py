"""``ragblend bench``: TTFT and fidelity of full / prefix / reuse / blend on a QA dataset."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, cast

from ragblend import cpu
from ragblend.config import (
    DECODE_ACTIVATIONS,
    KV_CACHE_DTYPES,
    KV_DTYPES,
    MODES,
    NEIGHBOUR_CONTEXTS,
    PRECOMPUTE_CONTEXTS,
    BlendConfig,
    kv_dtype_argument,
)
from ragblend.kernels import ROW_ATTENTION
from ragblend.models.gguf import WEIGHTS
from ragblend.models.quantized import quantized_weights, weight_bytes
from ragblend.store.cli import StoreFlags, add_store_arguments, open_store

if TYPE_CHECKING:
    from ragblend.engine import BlendEngine
    from ragblend.store.base import KVStore
    from ragblend.store.disk import DiskStore
    from ragblend.store.redis import RedisStore


def add_parser(sub) -> None:
    defaults = BlendConfig()
    p = sub.add_parser("bench", help="benchmark modes on a MuSiQue-format dataset")
    p.add_argument("--dataset", required=True, help="JSON list of {question, answers, ctxs}")
    p.add_argument("--limit", type=int, default=None, help="first N questions")
    p.add_argument("--top-k", type=int, default=6, help="chunks per question (first k ctxs)")
    p.add_argument("--chunk-tokens", type=int, default=512, help="cut each chunk to N tokens")
    p.add_argument("--modes", default="full,prefix,reuse,blend", help="comma-separated modes")
    p.add_argument(
        "--ratio",
        type=float,
        default=None,
        help=f"blend recompute ratio (default: engine default {defaults.ratio})",
    )
    p.add_argument(
        "--selector",
        default=None,
        help=f"token selector (default: engine default {defaults.selector})",
    )
    p.add_argument(
        "--tier", choices=("ram", "disk", "redis"), default="ram", help="where chunk KV lives"
    )
    add_store_arguments(
        p,
        disk_help="--tier disk: the directory (default: a new temp dir)",
        redis_help="--tier redis: redis://, rediss:// or unix:// URL",
        redis_default="redis://127.0.0.1:6379/0",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default=None, help="auto (default) / float32 / bfloat16 / float16")
    p.add_argument(
        "--weights",
        default=None,
        choices=WEIGHTS,
        help="a GGUF's quantized tensors: auto (default: kept as blocks) or dequantize",
    )
    p.add_argument(
        "--row-attention",
        choices=ROW_ATTENTION,
        default=None,
        help="blend's selected-row attention: auto (default) / native / sdpa / masked",
    )
    p.add_argument(
        "--kv-dtype",
        type=kv_dtype_argument,
        default=None,
        metavar="D",
        help=f"storage dtype or codec of chunk KV: {', '.join(KV_DTYPES)} or pca<bits> "
        f"(default: engine default {defaults.kv_dtype})",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="the decode-time K/V cache: auto (default: the model's dtype) or int8",
    )
    p.add_argument(
        "--decode-activations",
        choices=DECODE_ACTIVATIONS,
        default=None,
        help="what decode steps multiply a GGUF's quantized weights by: float (exact), int8 "
        "(llama.cpp's 8-bit activations) or auto (default: per CPU level)",
    )
    p.add_argument(
        "--precompute-context",
        choices=PRECOMPUTE_CONTEXTS,
        default=None,
        help="what chunks are precomputed after (default: engine default "
        f"{defaults.precompute_context}); neighbours: their most similar passages of the "
        "dataset file (MiniLM embeddings), previous: the passage before them in their case",
    )
    p.add_argument(
        "--precompute-neighbours",
        type=int,
        default=None,
        help=f"neighbours per chunk (default: engine default {defaults.precompute_neighbours})",
    )
    p.add_argument(
        "--exact-first-chunk",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also store each chunk as a prompt's first chunk sees it, taken exactly (default: "
        f"engine default {defaults.exact_first_chunk})",
    )
    p.add_argument(
        "--model",
        default="embedded",
        help="'embedded', 'gemma', a .gguf file or a local HF model dir",
    )
    p.add_argument("--repeats", type=int, default=3, help="TTFT repetitions per question")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run)


# BlendConfig fields ``bench`` sets from its flag of the same name where that flag is given:
# the ones whose unset value is None or "" (falsy), and the ones where only None is unset
_FLAGS_SET_WHEN_TRUTHY = (
    "dtype",
    "row_attention",
    "weights",
    "selector",
    "kv_dtype",
    "kv_cache_dtype",
    "decode_activations",
    "namespace",
    "precompute_context",
)
_FLAGS_SET_WHEN_GIVEN = ("ratio", "precompute_neighbours", "exact_first_chunk")


def _config_overrides(args: argparse.Namespace) -> dict:
    """The BlendConfig fields the command line sets (the rest keep their defaults)."""
    out = {name: getattr(args, name) for name in _FLAGS_SET_WHEN_TRUTHY if getattr(args, name)}
    for name in _FLAGS_SET_WHEN_GIVEN:
        if getattr(args, name) is not None:
            out[name] = getattr(args, name)
    return out


def run(args: argparse.Namespace) -> int:
    import tempfile

    import torch

    from ragblend.bench.datasets import load_cases
    from ragblend.bench.harness import Variant, run_benchmark
    from ragblend.bench.plots import plot_ttft_vs_quality
    from ragblend.engine import BlendEngine
    from ragblend.errors import RagblendError

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    peer = "llamacpp" in modes  # optional llama.cpp baseline (ragblend.bench.llamacpp)
    modes = [m for m in modes if m != "llamacpp"]
    for m in modes:
        if m not in MODES:
            raise RagblendError(f"unknown mode {m!r}; expected some of {', '.join(MODES)}")
    config = BlendConfig(device=args.device, **_config_overrides(args))
    store: KVStore | None = None
    before = None
    if args.tier == "disk":
        path = args.store_path or tempfile.mkdtemp(prefix="ragblend-bench-kv-")
        disk = cast("DiskStore", open_store(StoreFlags(store_path=path)))
        store, drop = disk, disk.drop_page_cache

        def before(variant):  # cold reads: no RAM tier, OS page cache dropped
            if variant.mode in ("reuse", "blend"):
                drop()

    if args.tier == "redis":
        flags = StoreFlags(redis_url=args.redis_url, namespace=args.namespace)
        redis_store = cast("RedisStore", open_store(flags))
        store = redis_store
        before = lambda variant: redis_store.flush()  # noqa: E731  (measure reads from Redis)
    engine = BlendEngine.from_pretrained(args.model, config=config, store=store)
    cases = load_cases(args.dataset, engine.tokenizer, args.top_k, args.chunk_tokens, args.limit)
    if config.precompute_context in NEIGHBOUR_CONTEXTS:
        from ragblend.bench.neighbours import with_dataset_neighbours

        explicit = args.precompute_context is not None
        engine = with_dataset_neighbours(engine, args.dataset, args.chunk_tokens, explicit)
        config = engine.config
    variants = [Variant(m, m) for m in modes]
    results = run_benchmark(engine, cases, variants, args.repeats, args.max_new_tokens, before)
    if peer:
        from ragblend.bench.llamacpp import run_peer
        from ragblend.models.loading import gguf_source

        gguf = gguf_source(args.model)
        if gguf is None:
            raise RagblendError("the llamacpp mode runs GGUF models: pass 'embedded' or a .gguf")
        ids = [engine.tokenize(c.question, c.chunks).ids for c in cases]
        results["peers"] = {"llamacpp": run_peer(gguf, ids, args.repeats)}
    results["settings"] = {
        "model": engine.name,
        "device": args.device,
        "dtype": str(engine.layers.dtype).replace("torch.", ""),
        "decode_path": engine.decode_path,
        "weights": "quantized" if quantized_weights(engine.model) else "dequantized",
        "weight_bytes": weight_bytes(engine.model),
        "row_attention": engine.row_attention,
        "top_k": args.top_k,
        "chunk_tokens": args.chunk_tokens,
        "ratio": config.ratio,
        "check_layers": list(config.check_layers),
        "check_scales": list(config.check_scales) if config.check_scales else None,
        "selector": config.selector,
        "deviation": config.selection.deviation,
        "cached_temperature": config.selection.cached_temperature,
        "fitted_chunk_weight": config.selection.fitted_chunk_weight,
        "chunk_start_tokens": config.chunk_start_tokens,
        "near_question_tokens": config.near_question_tokens,
        "exact_first_chunk": config.exact_first_chunk,
        "precompute_context": config.precompute_context,
        "precompute_neighbours": (
            config.precompute_neighbours if config.precompute_context == "neighbours" else None
        ),
        "tier": args.tier,
        "kv_dtype": engine.kv_dtype,
        "kv_cache_dtype": config.kv_cache_dtype,
        "decode_activations": engine.decode_activations,
        **stored_sizes(engine, cases),
        "namespace": args.namespace,
        "n": len(cases),
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        **cpu.describe(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot_ttft_vs_quality(results, out / "ttft_vs_quality.png")
    print_table(results)
    print(f"wrote {out / 'results.json'} and {out / 'ttft_vs_quality.png'}")
    return 0


def stored_sizes(engine: BlendEngine, cases) -> dict:
    """``kv_bytes_per_token``: bytes the cases' stored chunk entries take per token (the entry
    a prompt reads for each chunk, scales or statistics included); ``stored_bytes_per_chunk_token``:
    every entry stored per chunk (with the first chunk's exact entry where there is one),
    per chunk token. Formula values (``ragblend.store.quant.kv_bytes_per_token``) where no
    entry is stored (a run of ``full`` alone)."""
    from ragblend.store.quant import kv_bytes_per_token

    entry = every = tokens = 0
    for case in cases:
        prompt = engine.tokenize(case.question, case.chunks)
        for got in engine.chunks.stored_entries(prompt.chunks, prompt.head):
            entry += got[0].nbytes
            every += sum(e.nbytes for e in got)
            tokens += got[0].num_tokens
    if not tokens:
        lay = engine.layers
        shape = (lay.num_layers, lay.num_kv_heads, lay.head_dim)
        bpt = kv_bytes_per_token(engine.kv_dtype, *shape, 512)
        return {"kv_bytes_per_token": bpt, "stored_bytes_per_chunk_token": None}
    return {"kv_bytes_per_token": entry / tokens, "stored_bytes_per_chunk_token": every / tokens}


def print_table(results: dict) -> None:
    cols = (
        "ttft_ms_median",
        "f1",
        "agreement_with_full",
        "first_token_kl_mean",
        "answer_kl_mean",
        "recomputed_fraction_mean",
        "decode_tokens_per_s",
    )
    print(f"{'mode':<14}" + "".join(f"{c:>22}" for c in cols) + f"{'speedup':>10}")
    for name, m in results["modes"].items():
        sp = results["speedup_vs_full"].get(name, 1.0)
        print(f"{name:<14}" + "".join(f"{m[c]:>22.4f}" for c in cols) + f"{sp:>10.2f}")
