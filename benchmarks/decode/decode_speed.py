"""Decode tokens/s at a long context: DynamicCache vs StaticCache vs LayerDecoder (interleaved).

    python benchmarks/decode/decode_speed.py --context 3200 --tokens 32 --rounds 5

All variants decode greedily from the same full prefill of ``--context`` random tokens on the
embedded model: "dynamic" is what decoding did first (HF's forward over a deep copy of the
prompt cache, grown by concatenation on every token), "static" HF's forward over a
preallocated ``StaticCache``, "layerwise" ragblend's ``LayerDecoder``, "packed" the same with
one-row linears on prepacked oneDNN weights, q/k/v and gate/up fused
(``BlendConfig.packed_decode``, the default for bf16 on CPU; ``ragblend.models.packed``). The
other variants run with packing off. Each variant decodes ``--warmup`` tokens before its clock
starts: the variants read different copies of the weights, and the first steps after a switch
pay for bringing them back into the CPU caches, which a request decoding on its own does not.
Prints per-round tokens/s and the medians of the per-round ratios to "dynamic".
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

import ragblend.decode.generation as generation
from ragblend import BlendEngine, SamplingParams
from ragblend.models.packed import pack_decode_linears, unpack_decode_linears


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=3200)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--warmup", type=int, default=4, help="tokens each variant decodes before the clock starts"
    )
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    engine = BlendEngine.from_pretrained("embedded", dtype=args.dtype, packed_decode=False)
    ids = torch.randint(100, 40000, (args.context,), generator=torch.Generator().manual_seed(0))
    pre = engine.full_prefill(ids.tolist())
    static_cache = generation.decode_cache
    kinds = ("dynamic", "static", "layerwise", "packed")

    def run(kind: str) -> float:
        generation.decode_cache = (
            static_cache if kind == "static" else lambda m, c, n: copy.deepcopy(c)
        )
        layers = engine.layers if kind in ("layerwise", "packed") else None
        if kind == "packed":  # the reordered weights are made here, outside the timing
            pack_decode_linears(engine.model)
        else:
            unpack_decode_linears(engine.model)
        stats = copy.copy(pre.stats)
        p = generation.Prefill(pre.logits, pre.cache, pre.prompt_ids, stats)
        eos: set[int] = set()  # decode exactly --warmup + --tokens tokens
        tokens = generation.decode_tokens(
            engine.model, p, SamplingParams(), args.warmup + args.tokens, eos, layers
        )
        for _ in range(args.warmup):
            next(tokens)
        t0 = time.perf_counter()
        n = sum(1 for _ in tokens)
        return n / (time.perf_counter() - t0)

    rows = []
    for _ in range(args.rounds):
        row = {f"{kind}_tokens_per_s": run(kind) for kind in kinds}
        row["static_over_dynamic"] = row["static_tokens_per_s"] / row["dynamic_tokens_per_s"]
        for kind in ("layerwise", "packed"):
            row[f"{kind}_over_dynamic"] = row[f"{kind}_tokens_per_s"] / row["dynamic_tokens_per_s"]
        rows.append(row)
        print(json.dumps(rows[-1]), flush=True)
    generation.decode_cache = static_cache
    summary = {
        "context": args.context,
        "tokens": args.tokens,
        "warmup": args.warmup,
        "dtype": str(engine.layers.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
    }
    for key in rows[0]:
        summary[f"{key}_median"] = statistics.median(r[key] for r in rows)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
