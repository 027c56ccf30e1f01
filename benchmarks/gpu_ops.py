"""Kernel launches and host syncs per layer of full / reuse / blend, counted on a CPU.

Counts, for one prefill per mode on a random-weight model shape (``ragblend.bench.shapes``),
the aten ops that would launch a GPU kernel and the ops that make the host wait for the device,
per decoder layer and per prefill (``ragblend.bench.op_kinds``: what counts and why). The engine
is built on CPU so that it takes the device path a GPU runs: fp32, ``row_attention="masked"``
(one SDPA call per layer with masks built on the device: a GPU's ``auto``; no native CPU
kernels) and layers loaded on the calling thread (a RAM store with ``prefetch_depth`` 0:
dispatch modes are thread-local; its entries are host tensors, the RAM tier's place on a GPU).
The tiny shape gets ``--layers`` (default 12) so that the default check layers (1 and 10) and
the ordinary layers between them are all there. One uncounted prefill per mode first, so
one-time builds are excluded. ``--row-attention sdpa`` counts the position-ordered SDPA blocks.

Writes ``OUT/gpu_ops.json``::

    {"modes": {"full" | "reuse" | "blend": {"kernels_per_layer", "kernels_per_check_layer",
                                            "syncs_per_layer", "syncs_per_prefill", ...}},
     "by_chunks": {"3": {"full": {...}, ...}, "6": ..., "12": ...},
     "settings": {...}, "environment": {...}}

``modes`` holds the ``--chunks`` layout; ``by_chunks`` every count of ``--layouts``.

    python benchmarks/gpu_ops.py --shape tiny --out out/gpu_ops
    python benchmarks/gpu_ops.py --shape tiny --layouts 6 --debug --out /tmp/ops  # sync sites
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run from a checkout without an installed ragblend
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ragblend.bench.gpu_ops import count_prefill  # noqa: E402
from ragblend.bench.op_counter import DeviceTracker  # noqa: E402
from ragblend.bench.shapes import SHAPES, random_ids, shape_engine  # noqa: E402
from ragblend.engine import BlendEngine  # noqa: E402
from ragblend.prompt import TokenizedPrompt  # noqa: E402
from ragblend.store.memory import MemoryStore  # noqa: E402

MODES = ("full", "reuse", "blend")
# Per shape: chunk tokens, head tokens, question tokens (gpu_bench.py's tiny / full defaults).
TINY_DEFAULTS = dict(chunk_tokens=64, head_tokens=16, question_tokens=8)
FULL_DEFAULTS = dict(chunk_tokens=512, head_tokens=48, question_tokens=32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="tiny", help=f"one of {', '.join(SHAPES)} (default tiny)")
    ap.add_argument("--chunks", type=int, default=6, help="chunks of the main layout (default 6)")
    ap.add_argument(
        "--layouts",
        default="3,6,12",
        help="chunk counts to count, comma-separated (default 3,6,12; --chunks is added)",
    )
    ap.add_argument(
        "--chunk-tokens", type=int, default=None, help="tokens per chunk (default 64; tiny: 64)"
    )
    ap.add_argument("--head-tokens", type=int, default=None, help="prompt head (default 16)")
    ap.add_argument("--question-tokens", type=int, default=None, help="question (default 8)")
    ap.add_argument("--separator-tokens", type=int, default=1, help="between chunks (default 1)")
    ap.add_argument("--modes", default=",".join(MODES), help="default full,reuse,blend")
    ap.add_argument(
        "--row-attention",
        default="masked",
        choices=("masked", "sdpa"),
        help="blend's selected-row attention: masked (default: a GPU's path) or sdpa (blocks)",
    )
    ap.add_argument(
        "--layer-kernels",
        default="fused",
        choices=("hf", "fused"),
        help="the layer steps: fused (default: one op per norm, RoPE, K/V scatter and SiLU "
        "product, as a GPU runs them with Triton kernels) or hf (HF's modules)",
    )
    ap.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: the shape's; tiny: 12)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--debug", action="store_true", help="record each sync's call site (sync_sites)"
    )
    ap.add_argument("--out", default="out/gpu_ops", help="output directory (default out/gpu_ops)")
    args = ap.parse_args(argv)
    if args.shape not in SHAPES:
        ap.error(f"unknown shape {args.shape!r}; expected one of {', '.join(SHAPES)}")
    defaults = TINY_DEFAULTS if args.shape == "tiny" else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    counts = {int(c) for c in args.layouts.split(",") if c.strip()} | {args.chunks}
    if min(counts) < 1:
        ap.error("chunk counts must be >= 1")
    args.chunk_counts = sorted(counts)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.mode_list:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; expected some of {', '.join(MODES)}")
    return args


def build_engine(args: argparse.Namespace) -> tuple[BlendEngine, MemoryStore]:
    """The engine on the generic device path (see the module docstring), on CPU in fp32."""
    layers = args.layers or (12 if args.shape == "tiny" else None)
    store = MemoryStore(1 << 40)
    engine, _ = shape_engine(
        args.shape,
        torch.device("cpu"),
        "float32",
        args.seed,
        store,
        model_overrides={"num_hidden_layers": layers} if layers else None,
        row_attention=args.row_attention,
        layer_kernels=args.layer_kernels,
    )
    return engine, store


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    engine, store = build_engine(args)
    vocab = int(engine.model.config.vocab_size)
    rng = random.Random(args.seed)
    head = [int(engine.model.config.bos_token_id)] + random_ids(rng, args.head_tokens - 1, vocab)
    sep = random_ids(rng, args.separator_tokens, vocab) if args.separator_tokens else []
    question = random_ids(rng, args.question_tokens, vocab)
    chunks = [random_ids(rng, args.chunk_tokens, vocab) for _ in range(max(args.chunk_counts))]
    for c in chunks:
        engine.precompute_ids(c, head)
    store.prefetch_depth = 0  # layers loaded on this thread, where the counter sees them
    if engine.row_attention == "native":
        raise SystemExit("gpu_ops.py: error: native CPU kernels are no GPU path")

    tracker = DeviceTracker.for_model(engine.model)  # one for the engine's whole life
    by_chunks: dict[str, dict] = {}
    for k in args.chunk_counts:
        prompt = TokenizedPrompt(head, chunks[:k], sep, question)
        per_mode = {}
        for mode in args.mode_list:
            ops = count_prefill(engine, prompt, mode, warmup=1, debug=args.debug, tracker=tracker)
            per_mode[mode] = {"prompt_tokens": len(prompt), **ops.as_dict()}
            print(
                f"{k:>3} chunks × {args.chunk_tokens} ({len(prompt)} tokens) {mode:>5}: "
                f"{ops.kernels_per_layer} kernels/layer, {ops.kernels_per_check_layer} per "
                f"check layer, {ops.syncs_per_layer} syncs/layer, {ops.syncs_per_prefill} "
                f"syncs/prefill {ops.sync_ops}",
                flush=True,
            )
        by_chunks[str(k)] = per_mode

    results = {
        "modes": by_chunks[str(args.chunks)],
        "by_chunks": by_chunks,
        "settings": {
            **{k: v for k, v in vars(args).items() if k not in ("chunk_counts", "mode_list")},
            "chunk_counts": args.chunk_counts,
            "dtype": "float32",
            "device": "cpu",
            "row_attention": engine.row_attention,
            "layer_kernels": args.layer_kernels,
            "prefetch_depth": store.prefetch_depth,
            "ratio": engine.config.ratio,
            "check_layers": list(engine.config.check_layers),
            "check_scales": list(engine.config.check_scales or []),
            "num_layers": engine.layers.num_layers,
            "buckets": "setup: before layer 0's input_layernorm; layer i: from its "
            "input_layernorm to the next layer's (includes loading layer i+1's KV); tail: from "
            "the final norm on",
        },
        "environment": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "seconds": round(time.perf_counter() - t0, 2),
        },
    }
    path = out / "gpu_ops.json"
    path.write_text(json.dumps(results, indent=2))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
