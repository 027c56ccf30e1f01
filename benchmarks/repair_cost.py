"""What stale-row repair during decode would cost: a decode step carrying R extra rows.

KVShare-style repair recomputes not-yet-recomputed prompt rows while decoding; each step then
runs 1 + R rows through every layer (over the whole prompt's KV) instead of one. This times an
HF forward of 1 + R new rows after a full prefill of one question's ≈3.2k-token prompt,
interleaved over rounds (median per R), against R = 0, and the cost per row of a full
prefill for scale. Ratios only on a shared machine.

    OMP_NUM_THREADS=1 python benchmarks/repair_cost.py --dataset ../shared/data/musique_dev.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ragblend import BlendEngine
from ragblend.bench.datasets import load_cases


@torch.inference_mode()
def step_ms(engine: BlendEngine, cache, n: int, rows: int) -> float:
    """One forward of ``1 + rows`` tokens after the prompt's ``n`` cached rows, in ms."""
    ids = torch.full((1, 1 + rows), 42, device=engine.layers.device)
    start = time.perf_counter()
    engine.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    elapsed = (time.perf_counter() - start) * 1000
    cache.crop(-(1 + rows))  # drop the step's rows again (this transformers: a negative count)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--offset", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="0,2,4,8,16,32,64,128")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out")
    args = ap.parse_args()
    engine = BlendEngine.from_pretrained("embedded", dtype=args.dtype)
    case = load_cases(args.dataset, engine.tokenizer, 6, 512, args.offset + 1)[args.offset]
    prompt = engine.tokenize(case.question, case.chunks)
    start = time.perf_counter()
    pre = engine.full_prefill(prompt.ids)
    prefill_ms = (time.perf_counter() - start) * 1000
    n = len(prompt.ids)
    rows = [int(r) for r in args.rows.split(",")]
    times: dict[int, list[float]] = {r: [] for r in rows}
    step_ms(engine, pre.cache, n, 0)  # warm
    for _ in range(args.rounds):
        for r in rows:
            times[r].append(step_ms(engine, pre.cache, n, r))
    med = {r: statistics.median(ts) for r, ts in times.items()}
    result = {
        "prompt_tokens": n,
        "full_prefill_ms": prefill_ms,
        "full_prefill_ms_per_row": prefill_ms / n,
        "step_ms_median": med,
        "step_vs_plain": {r: med[r] / med[0] for r in rows},
        "extra_ms_per_row": {r: (med[r] - med[0]) / r for r in rows if r},
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
