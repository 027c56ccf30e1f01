"""Kept quantized blocks vs dequantized weights on one GGUF: TTFT and decode, interleaved.

    python benchmarks/decode/quant_weights.py [--model embedded] [--dtypes float32,bfloat16] \\
        [--questions 6] [--repeats 3] [--decode-tokens 64] --out DIR

Loads the model once per (dtype, weights) pair in one process: ``dequantize`` (every weight
dense, the behaviour before quantized kernels) and ``auto`` (blocks kept: decode steps on the
blocks, prefills dequantizing each layer's weights as it runs). Engines of one dtype share one
KV store (one fingerprint). Per MuSiQue dev question (6 chunks × ≤512 tokens, ≈3.2k prompt
tokens) and repeat, the variants take turns: full TTFT, blend TTFT, then ``--decode-tokens``
greedy tokens after the blend prefill. Writes ``DIR/quant_weights.json``: per variant the
medians, ``end_to_end_ms`` (blend TTFT + the tokens at the median rate), ``weight_bytes``, the
decode path, and the per-question ratios to the first variant (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

DATASET = Path(__file__).resolve().parents[3] / "shared" / "data" / "musique_dev.json"
WEIGHTS = ("dequantize", "auto")


def engines(args: argparse.Namespace) -> dict:
    from ragblend import BlendConfig, BlendEngine
    from ragblend.store import MemoryStore

    out = {}
    for dtype in args.dtypes.split(","):
        store = MemoryStore(4 << 30)
        for weights in WEIGHTS:
            config = BlendConfig(dtype=dtype, weights=weights)
            engine = BlendEngine.from_pretrained(args.model, config=config, store=store)
            out[f"{dtype}/{weights}"] = engine
        pair = [out[f"{dtype}/{w}"].fingerprint for w in WEIGHTS]
        assert pair[0] == pair[1], "the two weights of one dtype share their chunk caches"
    return out


def decode_rate(engine, prefill, tokens: int) -> float:
    from ragblend import SamplingParams
    from ragblend.decode.generation import decode_tokens

    engine.prepare_decode()
    start = time.perf_counter()
    steps = decode_tokens(
        engine.model, prefill, SamplingParams(), tokens + 1, set(), engine.layers, engine.native
    )
    count = sum(1 for _ in steps) - 1  # the first token comes from the prefill
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtypes", default="float32", help="comma-separated compute dtypes")
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--dataset", default=str(DATASET))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    import torch

    from ragblend.bench.datasets import load_cases
    from ragblend.cpu import describe
    from ragblend.models.quantized import weight_bytes

    runs = engines(args)
    variants = list(runs)
    first = runs[variants[0]]
    cases = load_cases(args.dataset, first.tokenizer, 6, 512, args.questions)
    samples: dict[str, dict[str, list[float]]] = {
        v: {"full_ms": [], "blend_ms": [], "decode_tok_s": []} for v in variants
    }
    for case in cases:
        for engine in runs.values():  # once per store
            engine.precompute(case.chunks)
        prompt = first.tokenize(case.question, case.chunks)
        for engine in runs.values():  # warm the code paths
            engine.prefill(prompt, "blend")
        per_q: dict[str, dict[str, list[float]]] = {
            v: {k: [] for k in samples[v]} for v in variants
        }
        for _ in range(args.repeats):
            for name, engine in runs.items():
                per_q[name]["full_ms"].append(engine.prefill(prompt, "full").stats.ttft_ms)
                blend = engine.prefill(prompt, "blend")
                per_q[name]["blend_ms"].append(blend.stats.ttft_ms)
                per_q[name]["decode_tok_s"].append(decode_rate(engine, blend, args.decode_tokens))
        for name in variants:
            for key, values in per_q[name].items():
                samples[name][key].append(statistics.median(values))
        print(
            json.dumps({n: {k: round(v[-1], 1) for k, v in s.items()} for n, s in samples.items()})
        )
    result: dict = {
        "settings": {
            "model": args.model,
            "dtypes": args.dtypes,
            "questions": len(cases),
            "repeats": args.repeats,
            "decode_tokens": args.decode_tokens,
            "torch_threads": torch.get_num_threads(),
            **describe(),
        },
        "variants": {},
    }
    base = samples[variants[0]]
    for name, engine in runs.items():
        s = samples[name]
        result["variants"][name] = {
            "weight_bytes": weight_bytes(engine.model),
            "decode_path": engine.decode_path,
            **{f"{k}_median": statistics.median(v) for k, v in s.items()},
            "blend_speedup_vs_own_full": statistics.median(
                f / b for f, b in zip(s["full_ms"], s["blend_ms"], strict=True)
            ),
            "end_to_end_ms": statistics.median(s["blend_ms"])
            + 1000 * args.decode_tokens / statistics.median(s["decode_tok_s"]),
            "blend_ttft_vs_first": statistics.median(
                a / b for a, b in zip(s["blend_ms"], base["blend_ms"], strict=True)
            ),
            "decode_vs_first": statistics.median(
                a / b for a, b in zip(s["decode_tok_s"], base["decode_tok_s"], strict=True)
            ),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_weights.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["variants"], indent=2))


if __name__ == "__main__":
    main()
