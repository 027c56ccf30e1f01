"""Prefill-time cost of a selector/option against the default at the same ratio (TTFT only).

Each round times every variant's blend prefill once on the same prompt, interleaved; the
report is the median over rounds of each variant's time / the default's time, so a shared or
noisy machine slows every variant alike within a round.

    python benchmarks/selector_overhead.py --dataset ../shared/data/musique_dev.json --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ragblend import BlendEngine
from ragblend.bench.datasets import load_cases

VARIANTS = {
    "kv (default)": {},
    "relevance-kv": {"selector": "relevance-kv"},
    "relevance-kv+starts16": {"selector": "relevance-kv", "chunk_start_tokens": 16},
    "kv T=1.1": {"cached_temperature": 1.1},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--offset", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    engine = BlendEngine.from_pretrained("embedded", dtype=args.dtype)
    case = load_cases(args.dataset, engine.tokenizer, 6, 512, args.offset + 1)[args.offset]
    engine.precompute(case.chunks)
    views = {name: engine.with_config(**o) for name, o in VARIANTS.items()}
    prompt = engine.tokenize(case.question, case.chunks)
    times: dict[str, list[float]] = {name: [] for name in views}
    for _ in range(args.rounds):
        for name, view in views.items():
            start = time.perf_counter()
            view.prefill(prompt, "blend")
            times[name].append(time.perf_counter() - start)
    base = times["kv (default)"]
    report = {
        name: {
            "median_s": statistics.median(t),
            "median_ratio_to_default": statistics.median(a / b for a, b in zip(t, base)),
        }
        for name, t in times.items()
    }
    print(json.dumps({"rounds": args.rounds, "tokens": len(prompt.ids), **report}, indent=2))


if __name__ == "__main__":
    main()
