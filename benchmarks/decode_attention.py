"""Speed of a decode step's attention over bf16 K/V: each native build, one call per layer.

For a model's attention shape (query heads, KV heads, head dim, layers), B requests each with
its own ``--context`` keys of random bf16 K/V per layer (distinct buffers per layer and
request, as a step reads them: from memory, not cache), the time of one decode step's
attention (every layer's call) for each build this CPU runs
(:func:`ragblend.fusion.cpu.native.decode_builds`):

- ``fp32_avx2``: fp32 math, bf16 widened, 8 lanes (the fp32 kernels' own build);
- ``fp32_avx512``: the same at 16 lanes (``avx512`` and above);
- ``bf16_dpbf16``: AVX512-BF16 dot products (``avx512_bf16`` and above; what a bf16 model
  decodes with there).

Each repeat runs every case once, in turn (interleaved); medians over repeats, with the K/V
bytes a step reads and the rate it reads them at.

    python benchmarks/decode_attention.py --out out/decode_attention
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ragblend import cpu
from ragblend.fusion.cpu.native import decode_builds

# name -> (query heads, KV heads, head dim, layers)
SHAPES = {
    "smollm2-135m": (9, 3, 64, 30),
    "qwen2.5-0.5b": (14, 2, 64, 24),
    "llama-3.2-3b": (24, 8, 128, 28),
}


def step(shape: tuple[int, int, int, int], context: int, batch: int) -> Callable[..., None]:
    """A decode step's attention for ``batch`` requests of ``context`` keys: call(kernel,
    q dtype) runs every layer's call once."""
    heads, kv_heads, dim, layers = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, batch, dim, generator=gen).bfloat16()
    k_new, v_new = torch.randn(2, 1, kv_heads, batch, dim, generator=gen).bfloat16()

    def buffers() -> list[list[torch.Tensor]]:
        return [
            [
                torch.randn(1, kv_heads, context + 1, dim, generator=gen).bfloat16()
                for _ in range(batch)
            ]
            for _ in range(layers)
        ]

    keys, values = buffers(), buffers()
    positions = [context] * batch

    def run(kernel: Callable[..., torch.Tensor], q_dtype: torch.dtype) -> None:
        qd = q.to(q_dtype)
        for layer in range(layers):
            kernel(qd, k_new, v_new, keys[layer], values[layer], positions, 0, dim**-0.5)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--contexts", nargs="+", type=int, default=[954, 3100])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("out/decode_attention"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = decode_builds()
    if not kernels:
        raise SystemExit("no native decode attention runs here (CPU level below avx2?)")
    results = []
    for name in args.shapes:
        shape = SHAPES[name]
        heads, kv_heads, dim, layers = shape
        for context in args.contexts:
            for batch in args.batches:
                run = step(shape, context, batch)
                times: dict[str, list[float]] = {build: [] for build in kernels}
                for kernel, q_dtype in kernels.values():
                    run(kernel, q_dtype)  # warm: first calls, page faults
                for _ in range(args.repeats):
                    for build, (kernel, q_dtype) in kernels.items():
                        start = time.perf_counter()
                        run(kernel, q_dtype)
                        times[build].append(time.perf_counter() - start)
                kv_bytes = 2 * layers * batch * kv_heads * (context + 1) * dim * 2
                row = {"shape": name, "context": context, "batch": batch, "kv_bytes": kv_bytes}
                for build, ts in times.items():
                    ms = statistics.median(ts) * 1e3
                    row[f"{build}_ms"] = round(ms, 3)
                    row[f"{build}_gb_s"] = round(kv_bytes / ms / 1e6, 1)
                results.append(row)
                print(json.dumps(row), flush=True)
    report = {
        "settings": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "builds": list(kernels),
            "cpu_isa": cpu.cpu_isa(),
            "cpu_model": cpu.cpu_model(),
            "machine": platform.machine(),
            "torch": torch.__version__,
        },
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_attention.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out / 'decode_attention.json'}")


if __name__ == "__main__":
    main()
