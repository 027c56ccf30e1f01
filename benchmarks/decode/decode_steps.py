"""Decode-step time of 1, 4 and 8 concurrent requests: what one step of a server's batch costs.

    python benchmarks/decode/decode_steps.py --out out/decode_steps.json
    python benchmarks/decode/decode_steps.py --model qwen2.5-0.5b-Q4_K_M.gguf --out …

For each ``--prompt-sizes`` entry ``KxN`` (the first MuSiQue dev case with its top K chunks of
N tokens and the question), one full prefill; then ``ragblend.decode.decoder.decode_batch``
steps of B decoders over copies of its cache, for each B of ``--batches`` in turn per repeat
(interleaved, so that a noisy neighbour hits all batch sizes alike), every repeat from the
same position. Reports the median ms per step over ``--repeats`` (each the mean of ``--steps``
steps) and ``ratio``: B requests' aggregate rate over one request's, the figure a server's
concurrent streams approach (``benchmarks/serve_load.py`` measures it through HTTP).

``--quant-builds avx512_bf16,avx512`` times a GGUF model's steps on each of these builds of
the quantized-weight kernels in turn within each repeat (one loaded model, interleaved), and
reports each build's step times and its ratio to the first build's.

``--kv-cache-dtype auto,int8`` times decoders of each decode-time K/V cache storage
(``BlendConfig.kv_cache_dtype``) in turn within each repeat, over the same prefill, the same
way (one set of decoders per storage, made once), and reports each one's step times and its
ratio to the first one's. ``--decode-activations float,int8`` does the same for
``BlendConfig.decode_activations`` (a GGUF's quantized linears: exact or 8-bit activations).
``--int8-builds ragblend_q8vnni,ragblend_q8amx`` times the 8-bit activations' kernel builds
(:data:`ragblend.kernels.cpu.int8_decode.BUILDS`) the way ``--quant-builds`` does the float ones.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from ragblend import BlendConfig, BlendEngine
from ragblend.bench.datasets import default_dataset, load_cases
from ragblend.bench.environment import cpu_environment, write_report
from ragblend.config import DECODE_ACTIVATIONS, KV_CACHE_DTYPES
from ragblend.decode.decoder import LayerDecoder, decode_batch
from ragblend.decode.generation import Prefill, decoder_for
from ragblend.kernels.cpu import int8_decode
from ragblend.kernels.cpu.quant_kernels import kernels_in_use, kernels_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="a GGUF file or HF directory")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weights", default="auto", help="auto (keep GGUF blocks) or dequantize")
    parser.add_argument(
        "--decode-activations",
        default="auto",
        help="auto, float or int8 (BlendConfig.decode_activations), or a comma list to compare",
    )
    parser.add_argument("--prompt-sizes", default="6x512,6x150", help="KxN: K chunks of N tokens")
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps per timing")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument(
        "--quant-builds", help="quantized-kernel builds to compare, e.g. avx512_bf16,avx512"
    )
    parser.add_argument(
        "--int8-builds",
        help="8-bit activation kernel builds to compare, e.g. ragblend_q8vnni,ragblend_q8amx",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="decode K/V cache storages to compare, e.g. auto,int8 (BlendConfig.kv_cache_dtype)",
    )
    parser.add_argument("--out", default="out/decode_steps.json")
    args = parser.parse_args()
    if args.quant_builds and args.int8_builds:
        parser.error("compare --quant-builds or --int8-builds, not both in one run")
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    numerics = args.decode_activations.split(",")
    if any(a not in DECODE_ACTIVATIONS for a in numerics):
        parser.error(f"--decode-activations takes some of {', '.join(DECODE_ACTIVATIONS)}")
    config = BlendConfig(dtype=args.dtype, weights=args.weights)
    engine = BlendEngine.from_pretrained(args.model, config=config)
    engine.prepare_decode()
    views = {a: engine.with_config(decode_activations=a) for a in numerics}
    builds: dict[str, Callable[[], AbstractContextManager[None]]] = {
        "default": contextlib.nullcontext
    }
    try:
        if args.quant_builds:
            builds = {
                level: functools.partial(kernels_in_use, kernels_of(level))
                for level in args.quant_builds.split(",")
            }
        if args.int8_builds:
            builds = {
                name: functools.partial(
                    int8_decode.int8_kernels_in_use, int8_decode.kernels_of(name)
                )
                for name in args.int8_builds.split(",")
            }
    except ValueError as exc:
        parser.error(str(exc))
    storages = args.kv_cache_dtype.split(",")
    if any(kv not in KV_CACHE_DTYPES for kv in storages):
        parser.error(f"--kv-cache-dtype takes some of {', '.join(KV_CACHE_DTYPES)}")
    # (build, activations, storage), named by what varies
    variants = [(name, a, kv) for name in builds for a in numerics for kv in storages]
    counts = (len(builds), len(numerics), len(storages))
    label = {v: " ".join(part for part, many in zip(v, counts) if many > 1) for v in variants}
    results: dict[str, dict[str, object]] = {}
    for size in args.prompt_sizes.split(","):
        chunks, tokens = (int(v) for v in size.split("x"))
        case = load_cases(default_dataset(), engine.tokenizer, chunks, tokens, 1)[0]
        prompt = engine.tokenize(case.question, case.chunks)
        prefill = engine.prefill(prompt, "full")
        room = args.steps * (args.repeats + 1) * len(builds) + 1
        decoders = {
            (a, kv): make_decoders(views[a], prefill, room, max(batches), kv)
            for a in numerics
            for kv in storages
        }
        times: dict[tuple[tuple[str, str, str], int], list[float]] = {
            (v, b): [] for v in variants for b in batches
        }
        for repeat in range(args.repeats + 1):  # the first: warm-up, not counted
            for name, a, kv in variants:
                with builds[name]():
                    for b in batches:
                        batch = decoders[a, kv][:b]
                        for d in batch:
                            d.position = len(prompt)
                        t0 = time.perf_counter()
                        for _ in range(args.steps):
                            decode_batch(batch, [100] * b)
                        if repeat:
                            ms = (time.perf_counter() - t0) / args.steps * 1e3
                            times[(name, a, kv), b].append(ms)
        first = variants[0]
        for v in variants:
            ms = {b: statistics.median(times[v, b]) for b in batches}
            one = ms[batches[0]] / batches[0]
            row: dict[str, object] = {
                "prompt_tokens": len(prompt),
                "ms_per_step": {str(b): round(m, 3) for b, m in ms.items()},
                "ratio": {str(b): round(b * one / m, 3) for b, m in ms.items()},
            }
            if v != first:
                row["step_time_over_" + label[first].replace(" ", "_")] = {
                    str(b): round(m / statistics.median(times[first, b]), 3) for b, m in ms.items()
                }
            results[f"{size} {label[v]}".strip()] = row
            print(
                f"{size} ({len(prompt)} tokens){' ' * bool(label[v])}{label[v]}: "
                + "  ".join(f"B={b} {ms[b]:.1f} ms ({b * one / ms[b]:.2f}x)" for b in batches),
                flush=True,
            )
    report = {
        "benchmark": "decode_steps",
        "settings": {
            "model": args.model,
            "dtype": str(engine.layers.dtype).removeprefix("torch."),
            "decode_path": engine.decode_path,
            "repeats": args.repeats,
            "steps": args.steps,
            "threads": args.threads,
            "quant_builds": args.quant_builds.split(",") if args.quant_builds else ["default"],
            "int8_builds": args.int8_builds.split(",") if args.int8_builds else ["default"],
            "decode_activations": {a: view.decode_activations for a, view in views.items()},
            "kv_cache_dtypes": storages,
        },
        **cpu_environment(),
        "results": results,
    }
    write_report(Path(args.out), report)


def make_decoders(
    engine: BlendEngine, prefill: Prefill, room: int, count: int, kv_cache_dtype: str
) -> list[LayerDecoder]:
    """``count`` layer-wise decoders over copies of ``prefill``'s cache with ``room`` tokens
    after it, their K/V cache stored as ``kv_cache_dtype``, multiplying as ``engine``'s
    decode steps do (``engine.decode_activations``); SystemExit where the model's decode
    steps run HF's modules instead."""
    total = len(prefill.prompt_ids) + room
    kv, activations = kv_cache_dtype, engine.decode_activations
    made = [
        decoder_for(engine.model, engine.layers, prefill, total, engine.native, kv, activations)
        for _ in range(count)
    ]
    decoders = [d for d in made if isinstance(d, LayerDecoder)]
    if len(decoders) != len(made):
        raise SystemExit("this model's decode steps run HF's modules, not batched ones")
    return decoders


if __name__ == "__main__":
    main()
