"""Background warmup's cost to a running query: blend TTFT with the warmup pool idle or busy.

    .venv/bin/python benchmarks/serving/warmup_interference.py --limit 6 --repeats 3 \\
        --dataset ../shared/data/musique_dev.json \\
        --out benchmarks/results/intel-amx/warmup_interference.json

Per question and repeat, interleaved: the same blend prefill (the question's chunks already
warm) while a ``WarmupPool`` (a) has nothing to do, (b) works through a backlog of other chunks
with ``pause_during_queries=True`` (the default: workers start no new item while a query runs),
(c) the same with pausing off. Reports the median over questions of TTFT / idle TTFT. The query
is marked with ``pool.query()``, as BlendLLM and ChatRagBlend do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ragblend import BlendEngine
from ragblend.bench.datasets import load_cases
from ragblend.warmup import WarmupPool

VARIANTS = ("idle", "paused", "unpaused")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = BlendEngine.from_pretrained("embedded")
    cases = load_cases(args.dataset, engine.tokenizer, args.top_k, args.chunk_tokens, args.limit)
    prompts = []
    for case in cases:
        engine.precompute(case.chunks)
        prompts.append(engine.tokenize(case.question, case.chunks))
    # other chunks for the backlog: never the query's own, a fresh variant per use
    backlog = (f"{c} (variant {i})" for i in range(10_000) for case in cases for c in case.chunks)
    ttft: dict[str, list[list[float]]] = {v: [[] for _ in prompts] for v in VARIANTS}
    for prompt in prompts:
        engine.prefill(prompt, "blend")  # warm-up
    for _ in range(args.repeats):
        for qi, prompt in enumerate(prompts):
            for variant in VARIANTS:
                pool = WarmupPool(engine, pause_during_queries=variant == "paused")
                if variant != "idle":
                    pool.warm([next(backlog) for _ in range(8)])
                    time.sleep(0.3)  # a worker is now inside a precompute
                with pool.query():
                    t0 = time.perf_counter()
                    engine.prefill(prompt, "blend")
                    ttft[variant][qi].append((time.perf_counter() - t0) * 1000)
                pool.close(wait=False)
                pool.wait(timeout=60)
    per_q = {v: [statistics.median(xs) for xs in ttft[v]] for v in VARIANTS}
    ratios = {
        v: statistics.median(a / b for a, b in zip(per_q[v], per_q["idle"], strict=True))
        for v in VARIANTS[1:]
    }
    result = {
        "settings": {
            "questions": len(prompts),
            "repeats": args.repeats,
            "dtype": str(engine.layers.dtype).removeprefix("torch."),
            "torch_threads": torch.get_num_threads(),
        },
        "median_ttft_ms": {v: statistics.median(xs) for v, xs in per_q.items()},
        "ttft_ratio_vs_idle": ratios,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
