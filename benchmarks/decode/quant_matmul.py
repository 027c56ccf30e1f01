"""Speed of the native GGUF block kernels (ragblend.kernels.cpu.quant_kernels) on one matrix.

For each of ``--types`` (default Q4_K, Q6_K and Q4_1; random valid blocks, ``--size`` x
``--size``, or ``--shape ROWS COLS``): ``matmul`` at n = 1, 4 and 16 rows of x (``--n``), x in
``--dtype`` (float32, or bfloat16 as a bf16 model's decode step), and ``dequantize`` to float32,
against ``F.linear`` on the weights of the same shape in that dtype. ``--builds`` times the
matmul of several kernel builds side by side (e.g. ``avx512_bf16,avx512``: bf16 products
against float32 ones; default: the build this CPU loads). Each
repeat runs every case once, in turn (interleaved, so that a noisy neighbour hits all cases
alike; every other repeat in reverse, the dequantize cases after the matmuls); the medians
are reported with GB/s of weight bytes read (blocks for the kernels,
float32 weights for F.linear) and, for dequantize, of float32 written. A matrix larger than
the CPU's last-level cache (e.g. ``--shape 151936 896``, Qwen2.5-0.5B's LM head) is read from
memory as a decode step reads it; a smaller one may stay in that cache between calls, so its
first case per repeat reads it from memory and the next ones from the cache.

    python benchmarks/decode/quant_matmul.py --out out/quant_matmul.json
    python benchmarks/decode/quant_matmul.py --types Q5_0,Q8_0 --shape 4864 896 --n 1,4,8 --out …
    python benchmarks/decode/quant_matmul.py --dtype bfloat16 --builds avx512_bf16,avx512 \\
        --n 1,4,8 …
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ragblend.bench.environment import cpu_environment, write_report
from ragblend.kernels.cpu.quant_kernels import (
    QUANT_TYPES,
    QuantKernels,
    dequantize_reference,
    kernels_of,
    quant_kernels,
    random_blocks,
)

DEFAULT_TYPES = ("Q4_K", "Q6_K", "Q4_1")
DEFAULT_ROWS = (1, 4, 16)


def cases(
    rows: int,
    cols: int,
    types: dict[str, int],
    ns: tuple[int, ...],
    dtype: torch.dtype,
    builds: dict[str, QuantKernels],
) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (a call to time, bytes of weights it reads), for a [rows, cols] weight; the
    matmuls of each of ``builds`` (level -> kernels; named by level when there are several)."""
    gen = torch.Generator().manual_seed(0)
    xs = {n: torch.randn(n, cols, generator=gen).to(dtype) for n in ns}
    kernels = next(iter(builds.values()))
    out: dict[str, tuple[Callable[[], object], int]] = {}
    weight = None
    for name, qtype in types.items():
        blocks = random_blocks(rows, cols, qtype, gen)
        weight = dequantize_reference(blocks, qtype, cols).to(dtype)
        nbytes = blocks.numel()
        for n in ns:  # each n's builds one after the other: the same cache state
            for level, k in builds.items():
                label = f"{name} {level}" if len(builds) > 1 else name
                out[f"{label} matmul n={n}"] = (
                    functools.partial(k.matmul, xs[n], blocks, qtype, cols, None),
                    nbytes,
                )
        out[f"{name} dequantize f32"] = (
            functools.partial(kernels.dequantize, blocks, qtype, cols, torch.float32),
            nbytes,
        )
    assert weight is not None
    short = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
    for n in ns:
        out[f"F.linear {short} n={n}"] = (functools.partial(F.linear, xs[n], weight), weight.nbytes)
    return out


def load_builds(levels: str | None, parser: argparse.ArgumentParser) -> dict[str, QuantKernels]:
    """level -> checked kernels: each of ``levels`` (comma-separated), or the build this CPU
    loads by default."""
    if not levels:
        kernels = quant_kernels()
        if kernels is None:
            raise SystemExit("the quantized-weight kernels are not available on this machine")
        return {kernels.level: kernels}
    try:
        return {level: kernels_of(level) for level in levels.split(",")}
    except ValueError as exc:
        parser.error(str(exc))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=4096, help="a square matrix's side")
    parser.add_argument(
        "--shape", type=int, nargs=2, metavar=("ROWS", "COLS"), help="instead of --size"
    )
    parser.add_argument("--types", default=",".join(DEFAULT_TYPES), help="e.g. Q5_0,Q8_0")
    parser.add_argument("--n", default=",".join(map(str, DEFAULT_ROWS)), help="rows of x")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--builds", help="kernel builds by CPU level, e.g. avx512_bf16,avx512")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="out/quant_matmul.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ids = {name: qtype for qtype, name in QUANT_TYPES.items()}
    unknown = [t for t in args.types.split(",") if t not in ids]
    if unknown:
        parser.error(f"unknown types {unknown}; known: {', '.join(ids)}")
    types = {t: ids[t] for t in args.types.split(",")}
    rows, cols = args.shape or (args.size, args.size)
    builds = load_builds(args.builds, parser)
    dtype = getattr(torch, args.dtype)
    timed = cases(rows, cols, types, tuple(int(n) for n in args.n.split(",")), dtype, builds)
    times: dict[str, list[float]] = {name: [] for name in timed}
    for call, _ in timed.values():  # warm up: caches, pages, thread pool
        call()
    # the dequantize cases (which write rows x cols floats, evicting the cache) after the
    # matmuls, and every other repeat in reverse, so that no case always follows the same one
    order = sorted(timed, key=lambda name: "dequantize" in name)
    for repeat in range(args.repeats):
        for name in order if repeat % 2 == 0 else reversed(order):
            call = timed[name][0]
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
    results = {}
    for name, (_, nbytes) in timed.items():
        median = statistics.median(times[name])
        row = {"median_ms": median * 1e3, "min_ms": min(times[name]) * 1e3}
        row["weights_gb_per_s"] = nbytes / median / 1e9
        if "dequantize" in name:
            row["f32_out_gb_per_s"] = rows * cols * 4 / median / 1e9
        results[name] = row
        extra = f", {row['f32_out_gb_per_s']:.1f} GB/s f32 out" if "f32_out_gb_per_s" in row else ""
        print(
            f"{name:24s} median {row['median_ms']:8.3f} ms (min {row['min_ms']:.3f}), "
            f"{row['weights_gb_per_s']:6.2f} GB/s weights{extra}"
        )
    report = {
        "benchmark": "quant_matmul",
        "shape": [rows, cols],
        "threads": args.threads,
        "repeats": args.repeats,
        **cpu_environment(),
        "kernel_builds": list(builds),
        "dtype": args.dtype,
        "types": list(types),
        "results": results,
    }
    write_report(Path(args.out), report)


if __name__ == "__main__":
    main()
