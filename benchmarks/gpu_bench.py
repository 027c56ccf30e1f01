"""TTFT of full / prefix / reuse / blend on 7B-8B-shaped models (random weights), for a GPU.

Builds Mistral-7B-v0.2- and Llama-3-8B-shaped models from their configs with random weights
(nothing is downloaded; weights are created on the device directly) and drives the engine with
random token ids, so no tokenizer or dataset is needed. Quality is meaningless with random
weights; this script measures time only.

What it measures, per model shape:

* TTFT per mode / recompute ratio / KV tier for chunk layouts (default 6×512, 12×512, 6×1024
  tokens plus a ~32-token question): full, prefix, reuse, blend at 0.05/0.10/0.15/0.20 and
  blend with ``ratio="auto"`` (loading controller). Tiers: ``ram`` (host memory, pinned on CUDA),
  ``disk`` (disk tier, OS page cache dropped before each cold measurement), optionally
  ``device`` (KV resident in GPU memory). Medians over ``--repeats`` interleaved rounds, with
  ``torch.cuda.synchronize()`` around each call on CUDA.
* The loading controller's decisions (``LoadingController.for_engine(...).decide(n)``) per tier.
* A request-rate sweep (paper Fig. 14): Poisson arrivals at several rates, one FIFO server doing
  one prefill at a time on a simulated clock (arrivals drawn up front, every prefill actually run
  and timed; TTFT = queueing delay + the measured prefill), mean TTFT vs rate for full and blend,
  and the throughput each sustains at equal mean TTFT.

Once per run: an attention micro-benchmark of the fusor's selected-rows attention (SDPA with
additive masks in position-ordered blocks, ``ragblend/fusion/attention.py``) against
FlexAttention with a block mask (CUDA only; skipped cleanly elsewhere).

Parts, in ``ragblend/bench/``: ``shapes`` (the model shapes), ``gpu_shape`` (one shape's run),
``gpu_timing`` (the timed sweeps), ``gpu_report`` (console tables and plots); this file is the
command line.

Writes ``OUT/results.json``, ``OUT/ttft_<shape>.png`` and ``OUT/rate_<shape>.png``.

    python benchmarks/gpu_bench.py --device cuda --shape mistral-7b --out out/gpu/mistral
    OMP_NUM_THREADS=1 python benchmarks/gpu_bench.py --device cpu --shape tiny --out /tmp/gb
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import torch

from ragblend.bench.environment import environment, nvidia_smi
from ragblend.bench.gpu_shape import run_shape
from ragblend.bench.gpu_timing import attention_bench
from ragblend.bench.harness import resolve_device
from ragblend.bench.shapes import SHAPES

FULL_DEFAULTS = dict(
    layouts="6x512,12x512,6x1024",
    head_tokens=48,
    question_tokens=32,
    rate_requests=40,
    num_rates=8,
    attn_keys="3072,6144",
)
TINY_DEFAULTS = dict(
    layouts="3x48,2x96",
    head_tokens=16,
    question_tokens=8,
    rate_requests=4,
    num_rates=3,
    attn_keys="256",
)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument(
        "--shape",
        default="mistral-7b",
        help=f"comma-separated model shapes: {', '.join(SHAPES)} (default mistral-7b)",
    )
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES), help="default bfloat16")
    ap.add_argument(
        "--layouts",
        default=None,
        help=f"chunks x tokens, comma-separated (default {FULL_DEFAULTS['layouts']}; "
        f"tiny: {TINY_DEFAULTS['layouts']})",
    )
    ap.add_argument(
        "--head-tokens",
        type=int,
        default=None,
        help="prompt head (BOS + template/system prompt) tokens (default 48; tiny: 16)",
    )
    ap.add_argument("--question-tokens", type=int, default=None, help="default 32; tiny: 8")
    ap.add_argument("--separator-tokens", type=int, default=1, help="between chunks (default 1)")
    ap.add_argument("--modes", default="full,prefix,reuse,blend", help="default: all four")
    ap.add_argument(
        "--ratios",
        default="0.05,0.1,0.15,0.2",
        help="blend recompute ratios (default 0.05,0.1,0.15,0.2)",
    )
    ap.add_argument("--no-auto", action="store_true", help="skip blend with ratio='auto'")
    ap.add_argument(
        "--fused",
        action="store_true",
        help="also time reuse and blend with layer_kernels='fused' (Triton layer steps on "
        "CUDA) in the same rounds",
    )
    ap.add_argument(
        "--tiers", default="ram,disk", help="KV tiers: ram, disk, device (default ram,disk)"
    )
    ap.add_argument(
        "--ram-prefetch",
        type=int,
        default=0,
        help="layers the RAM tier loads ahead (0: the engine's default for RAM, "
        "no pipelining; >0: pipelined like the disk tier)",
    )
    ap.add_argument(
        "--store-path",
        default=None,
        help="parent directory of the temporary disk tier (use a real disk, not "
        "tmpfs); default: the system temp dir",
    )
    ap.add_argument("--keep-store", action="store_true", help="do not delete the disk tier")
    ap.add_argument(
        "--repeats", type=int, default=5, help="interleaved measured rounds (default 5)"
    )
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    ap.add_argument("--skip-rates", action="store_true", help="skip the request-rate sweep")
    ap.add_argument(
        "--rate-layout", default=None, help="layout of the rate sweep (default: the first layout)"
    )
    ap.add_argument(
        "--rate-pool",
        type=int,
        default=None,
        help="distinct chunks requests draw from (default 2 × chunks/request)",
    )
    ap.add_argument(
        "--rate-requests", type=int, default=None, help="requests per rate (default 40; tiny: 4)"
    )
    ap.add_argument(
        "--rates",
        default="auto",
        help="requests/s, comma-separated, or 'auto' (0.3× full's capacity to "
        "1.2× blend's, geometric)",
    )
    ap.add_argument(
        "--num-rates", type=int, default=None, help="rates when --rates auto (default 8; tiny: 3)"
    )
    ap.add_argument(
        "--rate-ratio", type=float, default=0.15, help="blend ratio in the sweep (default 0.15)"
    )
    ap.add_argument(
        "--rate-tier",
        default="ram",
        choices=("ram", "disk", "device"),
        help="KV tier of the rate sweep (default ram)",
    )
    ap.add_argument(
        "--ttft-targets-ms",
        default=None,
        help="mean-TTFT targets for throughput at equal TTFT (default: 1.5, 2, 4 × "
        "full's unloaded TTFT)",
    )
    ap.add_argument(
        "--skip-attention", action="store_true", help="skip the attention micro-benchmark"
    )
    ap.add_argument("--attn-keys", default=None, help="key counts N (default 3072,6144; tiny: 256)")
    ap.add_argument(
        "--attn-ratio", type=float, default=0.15, help="selected rows m = ratio·N (default 0.15)"
    )
    ap.add_argument("--attn-iters", type=int, default=20, help="timed calls (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default="out/gpu_bench", help="output directory (default out/gpu_bench)"
    )
    args = ap.parse_args(argv)
    shapes = [s.strip() for s in args.shape.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; expected some of {', '.join(SHAPES)}")
    args.shapes = shapes
    defaults = TINY_DEFAULTS if shapes == ["tiny"] else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device, "gpu_bench.py")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = DTYPES[args.dtype]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "environment": environment(device),
        "settings": {k: v for k, v in vars(args).items() if k != "shapes"},
        "models": {},
    }
    if argv is not None:
        results["environment"]["argv"] = ["gpu_bench.py", *argv]
        results["environment"]["command"] = shlex.join(["benchmarks/gpu_bench.py", *argv])
    print(
        f"gpu_bench on {results['environment'].get('device_name')} ({device}), "
        f"torch {torch.__version__}",
        flush=True,
    )
    for shape in args.shapes:
        results["models"][shape] = run_shape(shape, args, device, out)
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    if not args.skip_attention:
        spec = SHAPES[args.shapes[0]]
        heads, kv_heads = spec["num_attention_heads"], spec["num_key_value_heads"]
        results["attention"] = attention_bench(
            args, device, dtype, heads, kv_heads, spec["hidden_size"] // heads
        )
        print("\nselected-rows attention (ms):")
        for c in results["attention"]["cases"]:
            flex = c.get("flex_ms", c.get("flex_error", results["attention"]["flex"]))
            print(
                f"  N={c['keys']} m={c['rows']}: sdpa_blocks {c['sdpa_blocks_ms']:.3f} "
                f"(plan {c['sdpa_blocks_plan_ms']:.3f}, err {c['sdpa_blocks_max_abs_err']:.1e})"
                f", full causal {c['full_causal_sdpa_ms']:.3f}, flex {flex}"
            )
    smi = nvidia_smi()
    if smi is not None:  # clocks right after the load (the first reading is usually idle)
        results["environment"]["nvidia_smi_after"] = smi
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {out / 'results.json'} and {', '.join(p.name for p in out.glob('*.png'))}")
    return results


if __name__ == "__main__":
    main()
