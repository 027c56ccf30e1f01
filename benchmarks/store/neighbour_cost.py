"""What a neighbour-aware chunk cache costs to precompute, per chunk, against an isolated one.

Per chunk (interleaved, one fresh store per measurement, the canonical head's prefix cache
warmed untimed), the time ``engine.precompute([chunk])`` takes with:

- ``canonical``: the chunk alone after the canonical head (the isolated cache);
- ``computed``: ``neighbours`` with ``neighbour_rows="computed"``: the chunk and its n
  neighbours prefilled together (n + 1 chunks' rows, attention over all of them);
- ``reused-missing``: ``neighbour_rows="reused"`` where no neighbour is stored yet: each
  neighbour's isolated KV is computed (and stored under its own key), then the chunk after
  their KV;
- ``reused-stored``: ``reused`` where the neighbours' caches are already stored — what a
  chunk costs once the index it joins is warm, and the rest of a corpus warmup: each chunk
  is computed at most once alone (as somebody's neighbour) and once after its neighbours;
- ``reused-stored-first``: ``reused-stored`` with ``exact_first_chunk``: the chunk also after
  the prompt head (the entry a prompt's first chunk takes exactly; the head's prefix cache
  warmed untimed). The other variants run without it.

Neighbours: the chunk's n most similar passages of the whole dataset file (MiniLM), as
``ragblend bench`` and ``benchmarks/quality/neighbour_contexts.py`` take them. Reports medians and
the median per-chunk ratio to ``canonical``; writes ``OUT/NAME.json``.

    python benchmarks/store/neighbour_cost.py --dataset ../shared/data/musique_dev.json \\
        --chunks 8 --out benchmarks/results/amd-avx512bf16
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
from ragblend.bench.neighbours import dataset_neighbours
from ragblend.cpu import cpu_isa, cpu_model
from ragblend.store.memory import MemoryStore

VARIANTS = ("canonical", "computed", "reused-missing", "reused-stored", "reused-stored-first")


def timed_precompute(engine: BlendEngine, variant: str, chunk: str, neighbours: list[str]) -> float:
    """Seconds to precompute ``chunk`` under ``variant``, in a fresh store (untimed set-up:
    the canonical head's cache and, for ``reused-stored``, the neighbours' own caches)."""
    context = "canonical" if variant == "canonical" else "neighbours"
    rows = "computed" if variant == "computed" else "reused"
    first = variant == "reused-stored-first"
    view = engine.with_config(
        precompute_context=context,
        neighbour_rows=rows,
        exact_first_chunk=first,
        store=MemoryStore(1 << 30),
    )
    view.chunks.prefix_kv(view.chunks.context_ids(view.prompt_head()))
    view.chunks.prefix_kv(view.prompt_head())
    if variant.startswith("reused-stored"):
        warm = view.with_config(exact_first_chunk=False)
        warm.precompute(neighbours, neighbours={nb: [] for nb in neighbours})
    start = time.perf_counter()
    view.precompute([chunk], neighbours={chunk: neighbours})
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--offset", type=int, default=20, help="chunks from questions after N")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--neighbours", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--name", default="neighbour_cost_smollm2_fp32")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    engine = BlendEngine.from_pretrained(args.model, dtype=args.dtype)
    cases = load_cases(args.dataset, engine.tokenizer, 6, args.chunk_tokens)[args.offset :]
    chunks = list(dict.fromkeys(c for case in cases for c in case.chunks))[: args.chunks]
    source = dataset_neighbours("neighbours", args.dataset, engine.tokenizer, args.chunk_tokens)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    ratios: dict[str, list[float]] = {v: [] for v in VARIANTS}
    timed_precompute(engine, "computed", chunks[0], source.neighbours(chunks[0], 1))  # warm-up
    for i, chunk in enumerate(chunks):
        nbs = source.neighbours(chunk, args.neighbours)
        for _ in range(args.repeats):
            row = {v: timed_precompute(engine, v, chunk, nbs) for v in VARIANTS}
            for v, t in row.items():
                times[v].append(t)
                ratios[v].append(t / row["canonical"])
        print(f"chunk {i + 1}/{len(chunks)}", flush=True)
    results = {
        "median_s": {v: statistics.median(ts) for v, ts in times.items()},
        "median_ratio_to_canonical": {v: statistics.median(r) for v, r in ratios.items()},
        "settings": {
            **vars(args),
            "torch_threads": torch.get_num_threads(),
            "cpu_isa": cpu_isa(),
            "cpu_model": cpu_model(),
            "dtype_resolved": str(engine.layers.dtype),
        },
        "times_s": times,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=2))
    print("| variant | median s/chunk | × canonical |\n|---|---:|---:|")
    for v in VARIANTS:
        s, r = results["median_s"][v], results["median_ratio_to_canonical"][v]
        print(f"| {v} | {s:.3f} | {r:.2f}× |")


if __name__ == "__main__":
    main()
