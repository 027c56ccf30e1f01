"""``ragblend demo``: precompute chunk KV, then answer dev questions in full and blend mode."""

from __future__ import annotations

import argparse

from ragblend.bench.datasets import default_dataset


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="answer a few dev questions in full and blend mode")
    p.add_argument(
        "--dataset",
        default=str(default_dataset()),
        help="MuSiQue-format JSON (default: the dev cases beside a checkout, else 4 shipped ones)",
    )
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument(
        "--model", default="embedded", help="'embedded', 'gemma', a .gguf file or an HF model dir"
    )
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import statistics
    import time

    from ragblend.bench.datasets import load_cases
    from ragblend.engine import BlendEngine

    t0 = time.perf_counter()
    engine = BlendEngine.from_pretrained(args.model)
    print(
        f"model {engine.name} loaded in {time.perf_counter() - t0:.1f}s "
        f"({engine.layers.num_layers} layers, ratio {engine.config.ratio}, "
        f"check layers {list(engine.config.check_layers)})"
    )
    cases = load_cases(
        args.dataset, engine.tokenizer, args.top_k, args.chunk_tokens, args.questions
    )
    chunks = [c for case in cases for c in case.chunks]
    t0 = time.perf_counter()
    engine.precompute(chunks, progress=True)
    print(
        f"precomputed KV of {len(chunks)} chunks in {time.perf_counter() - t0:.1f}s "
        f"(background work, once per chunk)\n"
    )
    speedups = []
    for i, case in enumerate(cases, 1):
        engine.generate(case.question, case.chunks, max_new_tokens=1)  # warm the code paths
        full = engine.generate(
            case.question, case.chunks, mode="full", max_new_tokens=args.max_new_tokens
        )
        blend = engine.generate(
            case.question, case.chunks, mode="blend", max_new_tokens=args.max_new_tokens
        )
        speedup = full.stats.ttft_ms / blend.stats.ttft_ms
        speedups.append(speedup)
        print(f"Q{i}: {case.question}  (gold: {', '.join(case.answers)})")
        print(f"  full  TTFT {full.stats.ttft_ms:7.0f} ms | {full.text.strip()!r}")
        print(
            f"  blend TTFT {blend.stats.ttft_ms:7.0f} ms | {blend.text.strip()!r}  "
            f"[{blend.stats.recomputed_fraction:.0%} recomputed, "
            f"{blend.stats.chunk_hits}/{len(case.chunks)} chunks hit]  → {speedup:.1f}× faster"
        )
    print(
        f"\nmedian TTFT speedup blend vs full: {statistics.median(speedups):.1f}× "
        f"on {len(cases)} questions × {args.top_k} chunks × ≤{args.chunk_tokens} tokens"
    )
    return 0
