"""Speed of bf16 decode-step linears: ragblend's native kernel against oneDNN and F.linear.

For SmolLM2-135M's weight shapes (random bf16 weights; q/k/v/o, gate/up/down and the 49k-row
LM head) at n = 1, 4, 8 and 16 rows of x, the time per call of:

- ``native``: :mod:`ragblend.kernels.cpu.dense_decode`'s ``matmul`` (each row the same in any
  batch),
  the build the CPU level selects (``avx512_bf16``: vdpbf16ps; the report's ``native_build``);
- ``native_fp32``: the ``avx512`` build of the same kernel (bf16 widened, fp32 FMAs), where
  that is not the selected build already;
- ``onednn``: oneDNN's linear on the weight reordered for one row, as
  ``ragblend.models.packed`` packs bf16 without the native kernel
  (``torch.ops.mkldnn._reorder_linear_weight`` + ``_linear_pointwise``), all n rows in one call
  (packed.py gives it one row only: its rows are not shown to be batch-invariant);
- ``f_linear``: plain ``F.linear`` (bf16 decode steps of 2+ rows without the native kernel).

Each repeat runs every case once, in turn (interleaved, so that a noisy neighbour hits all
cases alike); each case is the mean of a few calls in a row, and the medians over repeats are
reported, with ``step_ms``: one decode step's linears (30 layers of the seven projections, q/k/v
unfused, plus the LM head) from those medians.

    python benchmarks/decode/dense_bf16_decode.py --out out/dense_bf16_decode
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ragblend.bench.environment import cpu_environment, write_report
from ragblend.kernels.cpu.dense_decode import dense_kernel

# SmolLM2-135M: name -> (rows, cols), and how many of it one decode step runs
SHAPES = {
    "q_proj/o_proj": ((576, 576), 60),
    "k_proj/v_proj": ((192, 576), 60),
    "gate_proj/up_proj": ((1536, 576), 60),
    "down_proj": ((576, 1536), 30),
    "lm_head": ((49152, 576), 1),
}
ROWS = (1, 4, 8, 16)
METHODS = ("native", "native_fp32", "onednn", "f_linear")


def cases() -> dict[tuple[str, int, str], Callable[[], object]]:
    """(shape, n, method) -> a call to time."""
    kernel, fp32 = dense_kernel(), dense_kernel("avx512")
    if kernel is None or fp32 is None:
        raise SystemExit("the native bf16 kernel does not run here (CPU level below avx512?)")
    gen = torch.Generator().manual_seed(0)
    out: dict[tuple[str, int, str], Callable[[], object]] = {}
    for name, ((rows, cols), _) in SHAPES.items():
        weight = (torch.randn(rows, cols, generator=gen) / cols**0.5).bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        for n in ROWS:
            x = torch.randn(n, cols, generator=gen).bfloat16()
            out[name, n, "native"] = lambda x=x, w=weight: kernel.matmul(x, w, None)
            if fp32 is not kernel:
                out[name, n, "native_fp32"] = lambda x=x, w=weight: fp32.matmul(x, w, None)
            out[name, n, "onednn"] = lambda x=x, p=packed: torch.ops.mkldnn._linear_pointwise(
                x, p, None, "none", [], ""
            )
            out[name, n, "f_linear"] = lambda x=x, w=weight: F.linear(x, w)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--calls", type=int, default=10, help="calls per timing (LM head: 2)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, default=Path("out/dense_bf16_decode"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    timed = cases()
    times: dict[tuple[str, int, str], list[float]] = {key: [] for key in timed}
    with torch.inference_mode():
        for call in timed.values():  # warm up: caches, pages, thread pool
            call()
        for _ in range(args.repeats):
            for key, call in timed.items():
                calls = 2 if key[0] == "lm_head" else args.calls
                t0 = time.perf_counter()
                for _ in range(calls):
                    call()
                times[key].append((time.perf_counter() - t0) / calls)
    median = {key: statistics.median(t) * 1e6 for key, t in times.items()}
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, n, method in timed:
        row = results.setdefault(name, {}).setdefault(f"n={n}", {})
        row[f"{method}_us"] = round(median[name, n, method], 1)
    steps = {
        f"n={n}": {
            f"{m}_ms": round(sum(median[s, n, m] * k for s, (_, k) in SHAPES.items()) / 1e3, 3)
            for m in METHODS
            if ("lm_head", n, m) in median
        }
        for n in ROWS
    }
    for name, rows in results.items():
        for n, row in rows.items():
            print(f"{name:18s} {n:5s} " + "  ".join(f"{k} {v:9.1f}" for k, v in row.items()))
    for n, row in steps.items():
        print(f"{'step (135M)':18s} {n:5s} " + "  ".join(f"{k} {v:8.3f}" for k, v in row.items()))
    report = {
        "benchmark": "dense_bf16_decode",
        "threads": args.threads,
        "repeats": args.repeats,
        **cpu_environment(),
        "native_build": getattr(dense_kernel(), "level", None),
        "shapes": {name: list(shape) for name, (shape, _) in SHAPES.items()},
        "per_call_us": results,
        "step_ms": steps,
    }
    write_report(args.out / "dense_bf16_decode.json", report)


if __name__ == "__main__":
    main()
