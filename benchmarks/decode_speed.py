"""Decode tokens/s at a long context: preallocated StaticCache vs HF's DynamicCache (interleaved).

    python benchmarks/decode_speed.py --context 3200 --tokens 32 --rounds 5

Both variants decode greedily from the same full prefill of ``--context`` random tokens on the
embedded model; the DynamicCache variant is what decoding did before (a deep copy of the
prompt cache, grown by concatenation on every token). Prints per-round tokens/s and the median
of the per-round ratios.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

import ragblend.generation as generation
from ragblend import BlendEngine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=3200)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    engine = BlendEngine.from_pretrained("embedded", dtype=args.dtype)
    ids = torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0))
    pre = engine.full_prefill(ids.tolist())
    static_cache = generation.decode_cache

    def run(kind: str) -> float:
        generation.decode_cache = (
            static_cache if kind == "static" else lambda m, c, n: copy.deepcopy(c)
        )
        stats = copy.copy(pre.stats)
        p = generation.Prefill(pre.logits, pre.cache, pre.prompt_ids, stats)
        eos: set[int] = set()  # decode exactly --tokens tokens
        t0 = time.perf_counter()
        n = sum(
            1 for _ in generation.decode_tokens(engine.model, p, SamplingParams(), args.tokens, eos)
        )
        return n / (time.perf_counter() - t0)

    rows = []
    for _ in range(args.rounds):
        dynamic, static = run("dynamic"), run("static")
        rows.append(
            {
                "dynamic_tokens_per_s": dynamic,
                "static_tokens_per_s": static,
                "ratio": static / dynamic,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    generation.decode_cache = static_cache
    print(
        json.dumps(
            {
                "context": args.context,
                "tokens": args.tokens,
                "dtype": args.dtype,
                "torch_threads": torch.get_num_threads(),
                "dynamic_tokens_per_s_median": statistics.median(
                    r["dynamic_tokens_per_s"] for r in rows
                ),
                "static_tokens_per_s_median": statistics.median(
                    r["static_tokens_per_s"] for r in rows
                ),
                "ratio_median": statistics.median(r["ratio"] for r in rows),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
