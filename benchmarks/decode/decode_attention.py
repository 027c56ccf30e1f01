"""Speed of a decode step's attention over bf16 or 8-bit K/V: each native build, one call per layer.

For a model's attention shape (query heads, KV heads, head dim, layers), B requests each with
its own ``--context`` keys of random bf16 K/V per layer (distinct buffers per layer and
request, as a step reads them: from memory, not cache), the time of one decode step's
attention (every layer's call) for each build this CPU runs
(:func:`ragblend.kernels.cpu.native.decode_builds`):

- ``fp32_avx2``: fp32 math, bf16 widened, 8 lanes (the fp32 kernels' own build);
- ``fp32_avx512``: the same at 16 lanes (``avx512`` and above);
- ``bf16_dpbf16``: AVX512-BF16 dot products (``avx512_bf16`` and above; what a bf16 model
  decodes with there);
- ``int8_avx2``, ``int8_avx512``: the 8-bit K/V cache's kernel (``kv_cache_dtype="int8"``:
  the same random K/V quantized as llama.cpp's q8_0, fp32 q) at 8 and 16 lanes, each where
  the CPU level runs it (:data:`ragblend.kernels.cpu.decode_q8.Q8_BUILDS`).

Each repeat runs every case once, in turn (interleaved); medians over repeats, with the K/V
bytes a step reads and the rate it reads them at (``kv_bytes``: bf16; ``int8_kv_bytes``: the
codes and their scales).

    python benchmarks/decode/decode_attention.py --out out/decode_attention
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch

from ragblend import cpu
from ragblend.kernels.cpu.decode_q8 import Q8_BUILDS, Q8Kernel, q8_block, q8_kernel, quantize_q8
from ragblend.kernels.cpu.native import decode_builds

# name -> (query heads, KV heads, head dim, layers)
SHAPES = {
    "smollm2-135m": (9, 3, 64, 30),
    "qwen2.5-0.5b": (14, 2, 64, 24),
    "llama-3.2-3b": (24, 8, 128, 28),
}


class StepInputs(NamedTuple):
    """One decode step's random inputs: q [1, H, B, d], k_new, v_new [1, Hkv, B, d] (float32),
    and per layer and request the same random K/V [1, Hkv, context + 1, d] twice: in bf16
    (``keys``, ``values``) and quantized as the 8-bit cache holds it (``*_q8``: codes, scales)."""

    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    keys: list[list[torch.Tensor]]
    values: list[list[torch.Tensor]]
    keys_q8: list[list[tuple[torch.Tensor, torch.Tensor]]]
    values_q8: list[list[tuple[torch.Tensor, torch.Tensor]]]


def step_inputs(shape: tuple[int, int, int, int], context: int, batch: int) -> StepInputs:
    """Random inputs of a decode step for ``batch`` requests of ``context`` keys (distinct
    buffers per layer and request)."""
    heads, kv_heads, dim, layers = shape
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, batch, dim, generator=gen)
    k_new, v_new = torch.randn(2, 1, kv_heads, batch, dim, generator=gen)
    block = q8_block(dim)

    def buffers() -> tuple[list[list[torch.Tensor]], list[list[tuple[torch.Tensor, torch.Tensor]]]]:
        bf16, q8 = [], []
        for _ in range(layers):
            drawn = [
                torch.randn(1, kv_heads, context + 1, dim, generator=gen) for _ in range(batch)
            ]
            bf16.append([x.bfloat16() for x in drawn])
            q8.append([quantize_q8(x, block) for x in drawn])
        return bf16, q8

    (keys, keys_q8), (values, values_q8) = buffers(), buffers()
    return StepInputs(q, k_new, v_new, keys, values, keys_q8, values_q8)


def step(inputs: StepInputs, context: int) -> Callable[..., None]:
    """A decode step's attention over the bf16 K/V: call(kernel, q dtype) runs every layer's
    call once (q and the new K/V rounded to bf16)."""
    q, k_new, v_new = (t.bfloat16() for t in (inputs.q, inputs.k_new, inputs.v_new))
    positions = [context] * q.shape[2]
    scale = q.shape[-1] ** -0.5

    def run(kernel: Callable[..., torch.Tensor], q_dtype: torch.dtype) -> None:
        qd = q.to(q_dtype)
        for keys, values in zip(inputs.keys, inputs.values):
            kernel(qd, k_new, v_new, keys, values, positions, 0, scale)

    return run


def q8_step(inputs: StepInputs, context: int) -> tuple[Callable[[Q8Kernel], None], int]:
    """:func:`step` over the 8-bit K/V, q and the new K/V in float32: call(kernel) runs every
    layer's call once; with the bytes of codes and scales a step reads."""
    q, k_new, v_new = inputs.q, inputs.k_new, inputs.v_new
    positions = [context] * q.shape[2]
    scale = q.shape[-1] ** -0.5

    def run(kernel: Q8Kernel) -> None:
        for k, v in zip(inputs.keys_q8, inputs.values_q8):
            codes_k, scales_k = [c for c, _ in k], [s for _, s in k]
            codes_v, scales_v = [c for c, _ in v], [s for _, s in v]
            kernel(q, k_new, v_new, codes_k, scales_k, codes_v, scales_v, positions, 0, scale)

    kv_bytes = sum(
        c.numel() + 4 * s.numel() for layer in inputs.keys_q8 + inputs.values_q8 for c, s in layer
    )
    return run, kv_bytes


def int8_builds(dim: int) -> dict[str, Q8Kernel]:
    """The 8-bit cache's kernel builds this CPU runs for heads of ``dim``, by name."""
    return {
        f"int8_{build.level}": q8_kernel(build)
        for build, lanes in Q8_BUILDS
        if cpu.isa_at_least(build.level) and dim % lanes == 0 and q8_block(dim) % lanes == 0
    }


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
    int8_names: set[str] = set()
    for name in args.shapes:
        shape = SHAPES[name]
        heads, kv_heads, dim, layers = shape
        for context in args.contexts:
            for batch in args.batches:
                inputs = step_inputs(shape, context, batch)
                run = step(inputs, context)
                run_q8, int8_kv_bytes = q8_step(inputs, context)
                int8 = int8_builds(dim)
                int8_names.update(int8)
                cases: dict[str, Callable[[], None]] = {
                    **{build: partial(run, *kernel) for build, kernel in kernels.items()},
                    **{build: partial(run_q8, kernel) for build, kernel in int8.items()},
                }
                times: dict[str, list[float]] = {case: [] for case in cases}
                for call in cases.values():
                    call()  # warm: first calls, page faults
                for _ in range(args.repeats):
                    for case, call in cases.items():
                        start = time.perf_counter()
                        call()
                        times[case].append(time.perf_counter() - start)
                kv_bytes = 2 * layers * batch * kv_heads * (context + 1) * dim * 2
                row = {
                    "shape": name,
                    "context": context,
                    "batch": batch,
                    "kv_bytes": kv_bytes,
                    "int8_kv_bytes": int8_kv_bytes,
                }
                for case, ts in times.items():
                    ms = statistics.median(ts) * 1e3
                    read = int8_kv_bytes if case in int8 else kv_bytes
                    row[f"{case}_ms"] = round(ms, 3)
                    row[f"{case}_gb_s"] = round(read / ms / 1e6, 1)
                results.append(row)
                print(json.dumps(row), flush=True)
    report = {
        "settings": {
            **{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "builds": list(kernels) + sorted(int8_names),
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
