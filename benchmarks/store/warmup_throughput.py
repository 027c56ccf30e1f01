"""Warmup throughput: chunks/s of KV precompute (into the disk tier) vs plain HF prefill.

Plain prefill runs HF's forward on [prompt head + chunk] for each chunk — what an engine
without ragblend would pay to prefill that text. Precompute runs ``engine.precompute_ids``
into a fresh disk store (KV written, fsynced, indexed). Interleaved per chunk; medians.

    python benchmarks/store/warmup_throughput.py --dataset ../shared/data/musique_dev.json --limit 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ragblend import BlendEngine
from ragblend.bench.datasets import load_cases
from ragblend.prompt import encode
from ragblend.store import make_store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--limit", type=int, default=4, help="questions (× top-k chunks)")
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--tier", choices=("ram", "disk"), default="disk")
    ap.add_argument("--out", default=None, help="write JSON here")
    args = ap.parse_args()

    store = make_store(args.tier, path=tempfile.mkdtemp(prefix="ragblend-warmup-bench-"))
    engine = BlendEngine.from_pretrained("embedded", store=store)
    cases = load_cases(args.dataset, engine.tokenizer, args.top_k, args.chunk_tokens, args.limit)
    head = engine.prompt_head()
    chunks = [encode(engine.tokenizer, c) for case in cases for c in case.chunks]
    engine.prefix_kv(head)  # the shared head is computed once, like in a real warmup job
    plain, warm = [], []
    for ids in chunks:
        t0 = time.perf_counter()
        with torch.inference_mode():
            engine.model(torch.tensor([head + ids]), use_cache=True, logits_to_keep=1)
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        engine.precompute_ids(ids, head)
        warm.append(time.perf_counter() - t0)
    result = {
        "chunks": len(chunks),
        "tokens_per_chunk_mean": statistics.fmean(len(c) for c in chunks),
        "tier": args.tier,
        "plain_prefill_chunks_per_s": 1 / statistics.median(plain),
        "precompute_chunks_per_s": 1 / statistics.median(warm),
        "throughput_ratio": statistics.median(plain) / statistics.median(warm),
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
