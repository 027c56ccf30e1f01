"""Batched decode steps on 7B-8B-shaped models (random weights): B requests' tokens/s vs one's.

For each model shape (``ragblend.bench.shapes``; random weights built on the device, driven
with token ids only), one full prefill of a random prompt of ``--prompt-tokens`` ids; then B
decoders over copies of its cache (``engine.decoder(prefill, …)``) for each B of ``--batches``,
stepped ``--steps`` greedy steps together (``ragblend.decode.decoder.decode_batch``: one GEMM per
linear for all B rows, each decoder fed its own argmax token). Batch sizes are interleaved
within each repeat (a noisy neighbour hits all alike), every repeat from the prompt's end, with
``torch.cuda.synchronize()`` before and after each timing on CUDA. Where ``engine.decoder``
gives an ``HFDecoder`` (HF's forward; no batching) its decoders are stepped one by one, made
afresh before each timing, and ``path`` says so.

Per B: the median ms per step over ``--repeats``, tokens/s (B / step time) and ``ratio``: B's
aggregate tokens/s over B=1's (B=1 is always measured). Once per B, ``batched_equals_alone``:
whether the 4 greedy tokens of 4 steps of a decoder stepped alone equal every row's in a batch
of B (recorded, never failed: bf16 GEMMs of different batch sizes may round differently).

Writes ``OUT/gpu_decode.json``::

    {"shapes": {"<shape>": {"device", "dtype", "prompt_tokens", "path", "decode_path",
                            "batches": {"1": {"ms_per_step", "tokens_per_s", "ratio", ...},
                                        "8": {...}},
                            "batched_equals_alone": {"1": true, "8": true}, ...}},
     "settings": {...}, "environment": {...}}

    python benchmarks/gpu/gpu_decode.py --shape mistral-7b --device cuda --out out/gpu_decode
    OMP_NUM_THREADS=1 python benchmarks/gpu/gpu_decode.py --shape tiny --device cpu --out /tmp/gd
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run from a checkout without an installed ragblend
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from ragblend.bench.environment import environment, nvidia_smi  # noqa: E402
from ragblend.bench.harness import peak_memory, resolve_device, sync  # noqa: E402
from ragblend.bench.shapes import SHAPES, random_ids, shape_engine  # noqa: E402
from ragblend.decode.decoder import LayerDecoder, decode_batch  # noqa: E402
from ragblend.engine import BlendEngine  # noqa: E402
from ragblend.prompt import TokenizedPrompt  # noqa: E402
from ragblend.store.memory import MemoryStore  # noqa: E402

DTYPES = ("bfloat16", "float16", "float32")
FULL_DEFAULTS = dict(prompt_tokens=3157, steps=32, repeats=3)
TINY_DEFAULTS = dict(prompt_tokens=256, steps=8, repeats=2)
CHECK_TOKENS = 4  # greedy tokens compared, alone vs in a batch


def parse_shapes(values: list[str] | None, ap: argparse.ArgumentParser) -> list[str]:
    shapes = [s.strip() for v in (values or ["mistral-7b"]) for s in v.split(",") if s.strip()]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; expected some of {', '.join(SHAPES)}")
    return list(dict.fromkeys(shapes))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shape",
        action="append",
        help=f"model shape, repeatable or comma-separated: {', '.join(SHAPES)} "
        "(default mistral-7b)",
    )
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="default bfloat16 on CUDA, float32 on CPU",
    )
    ap.add_argument(
        "--batches", default="1,8", help="batch sizes B, comma-separated (default 1,8; 1 added)"
    )
    ap.add_argument(
        "--prompt-tokens", type=int, default=None, help="prompt length (default 3157; tiny: 256)"
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="decode steps per timing (default 32; tiny: 8)"
    )
    ap.add_argument(
        "--repeats", type=int, default=None, help="interleaved measured rounds (default 3; tiny: 2)"
    )
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also time the decode pool's CUDA-graph step with the fused layer steps "
        "(cuda_graphs=True, layer_kernels='fused'), interleaved with the eager step: 'graph'",
    )
    ap.add_argument(
        "--out", default="out/gpu_decode", help="output directory (default out/gpu_decode)"
    )
    args = ap.parse_args(argv)
    args.shapes = parse_shapes(args.shape, ap)
    defaults = TINY_DEFAULTS if args.shapes == ["tiny"] else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        batches = {int(b) for b in args.batches.split(",") if b.strip()}
    except ValueError:
        ap.error(f"--batches: expected integers, got {args.batches!r}")
    if not batches or min(batches) < 1:
        ap.error("--batches: batch sizes must be >= 1")
    args.batch_list = sorted(batches | {1})
    if args.prompt_tokens < 2 or args.steps < 1 or args.repeats < 1 or args.warmup < 0:
        ap.error("--prompt-tokens >= 2, --steps >= 1, --repeats >= 1, --warmup >= 0")
    return args


class Decoders:
    """``count`` decoders over copies of ``prefill``'s cache, reset to the prompt's end before
    each run: LayerDecoders stepped together, or HFDecoders (made afresh) one by one."""

    def __init__(self, engine: BlendEngine, prefill, count: int, room: int):
        self.engine, self.prefill, self.room = engine, prefill, room
        self.start = len(prefill.prompt_ids)
        self.first = int(prefill.logits.argmax())
        self.made = [engine.decoder(prefill, room) for _ in range(count)]
        self.batched = all(isinstance(d, LayerDecoder) for d in self.made)
        self.path = "layer_decode.decode_batch" if self.batched else "HFDecoder, one by one"

    def reset(self, b: int) -> list:
        if self.batched:
            for d in self.made[:b]:
                d.position = self.start
            return self.made[:b]
        # An HFDecoder's cache cannot be rewound: fresh ones (outside the timing).
        self.made[:b] = [self.engine.decoder(self.prefill, self.room) for _ in range(b)]
        return self.made[:b]

    def run(self, decoders: list, steps: int) -> list[list[int]]:
        """``steps`` greedy steps of ``decoders`` from the prefill's token; per decoder, the
        tokens the steps produced."""
        tokens = [self.first] * len(decoders)
        out: list[list[int]] = [[] for _ in decoders]
        for _ in range(steps):
            if self.batched:
                tokens = decode_batch(decoders, tokens).argmax(-1).tolist()
            else:
                tokens = [int(d.step(t).argmax()) for d, t in zip(decoders, tokens, strict=True)]
            for row, t in zip(out, tokens, strict=True):
                row.append(int(t))
        return out


def run_shape(shape: str, args: argparse.Namespace, device: torch.device) -> dict:
    engine, build_s = shape_engine(shape, device, args.dtype, args.seed, MemoryStore(1 << 30))
    model = engine.model
    engine.prepare_decode()
    vocab = int(model.config.vocab_size)
    rng = random.Random(args.seed)
    bos = int(model.config.bos_token_id)
    prompt = TokenizedPrompt([bos] + random_ids(rng, args.prompt_tokens - 1, vocab), [], [], [])
    sync(device)
    t0 = time.perf_counter()
    prefill = engine.prefill(prompt, mode="full")
    sync(device)
    prefill_ms = (time.perf_counter() - t0) * 1e3

    batches = args.batch_list
    room = max(args.steps, CHECK_TOKENS) + 1
    pool = Decoders(engine, prefill, max(batches), room)
    print(
        f"[{shape}] built in {build_s:.1f}s, prefill of {len(prompt)} tokens "
        f"{prefill_ms:.0f} ms; decode: {pool.path} ({engine.decode_path})",
        flush=True,
    )
    times: dict[int, list[float]] = {b: [] for b in batches}
    graph = None  # (decoders, times) of the CUDA-graph step, timed in the same rounds
    if args.cuda_graphs:
        view = engine.with_config(cuda_graphs=True, layer_kernels="fused")
        graph = (Decoders(view, prefill, max(batches), room), {b: [] for b in batches})
    for repeat in range(args.warmup + args.repeats):
        for b in batches:
            for decoders_of, timed in ((pool, times), *([graph] if graph else [])):
                decoders = decoders_of.reset(b)
                sync(device)
                t0 = time.perf_counter()
                decoders_of.run(decoders, args.steps)
                sync(device)
                if repeat >= args.warmup:
                    timed[b].append((time.perf_counter() - t0) / args.steps * 1e3)

    alone = pool.run(pool.reset(1), CHECK_TOKENS)[0]
    equal: dict[str, bool] = {}
    for b in batches:
        rows = alone if b == 1 else pool.run(pool.reset(b), CHECK_TOKENS)
        equal[str(b)] = b == 1 or all(row == alone for row in rows)

    table = rate_table(times)
    info = {
        "device": str(device),
        "dtype": args.dtype,
        "prompt_tokens": len(prompt),
        "steps": args.steps,
        "repeats": args.repeats,
        "path": pool.path,
        "decode_path": engine.decode_path,
        "native_attention": bool(pool.batched and pool.made[0].attend is not None),
        # the static decode pool's slots the batch steps in (0: a buffer per request)
        "decode_slots": getattr(getattr(pool.made[0], "pool", None), "slots", 0),
        "build_s": round(build_s, 3),
        "prefill_ms": round(prefill_ms, 3),
        "batches": table,
        "batched_equals_alone": equal,
        "alone_tokens": alone,
    }
    if graph is not None:
        decoders_of, graph_times = graph
        made = decoders_of.made[0]
        graph_pool = getattr(made, "pool", None)
        graph_alone = decoders_of.run(decoders_of.reset(1), CHECK_TOKENS)[0]
        info["graph"] = {
            "batches": rate_table(graph_times),
            # False where the capture failed and the step ran eagerly (one warning logged)
            "cuda_graphs_active": bool(graph_pool is not None and graph_pool.cuda_graphs),
            "layer_kernels": getattr(made.layer_kernels, "impl", None),
            "alone_tokens_equal_eager": graph_alone == alone,
        }
        del graph, decoders_of, made, graph_pool
    del pool, prefill, engine, model
    gc.collect()
    peak = peak_memory(device)
    if peak is not None:
        info["max_memory_allocated_bytes"] = peak
    return info


def rate_table(times: dict[int, list[float]]) -> dict[str, dict]:
    """Per batch size: median ms per step, tokens/s and the ratio to one stream's rate."""
    ms = {b: statistics.median(t) for b, t in times.items()}
    rate_one = 1e3 / ms[1]
    table = {}
    for b in sorted(times):
        rate = b * 1e3 / ms[b]
        table[str(b)] = {
            "ms_per_step": round(ms[b], 4),
            "tokens_per_s": round(rate, 3),
            "ratio": round(rate / rate_one, 4),
            "ms_per_step_repeats": [round(t, 4) for t in times[b]],
        }
    return table


def print_table(shape: str, info: dict) -> None:
    print(f"\n{shape} ({info['dtype']}, {info['prompt_tokens']} prompt tokens, {info['path']})")
    print(f"  {'B':>4} {'ms/step':>10} {'tokens/s':>11} {'ratio':>7}  batched==alone")
    for b, row in info["batches"].items():
        print(
            f"  {b:>4} {row['ms_per_step']:>10.3f} {row['tokens_per_s']:>11.1f} "
            f"{row['ratio']:>7.2f}  {info['batched_equals_alone'][b]}"
        )
    graph = info.get("graph")
    if graph is not None:
        print(f"  CUDA graph step (active: {graph['cuda_graphs_active']}):")
        for b, row in graph["batches"].items():
            print(
                f"  {b:>4} {row['ms_per_step']:>10.3f} {row['tokens_per_s']:>11.1f} "
                f"{row['ratio']:>7.2f}"
            )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device, "gpu_decode.py")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.dtype is None:
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "shapes": {},
        "settings": {
            k: v for k, v in vars(args).items() if k not in ("shape", "shapes", "batch_list")
        }
        | {"shapes": args.shapes, "batches": args.batch_list},
        "environment": environment(device),
    }
    path = out / "gpu_decode.json"
    t0 = time.perf_counter()
    for shape in args.shapes:
        results["shapes"][shape] = run_shape(shape, args, device)
        print_table(shape, results["shapes"][shape])
        path.write_text(json.dumps(results, indent=2, default=str))
    smi = nvidia_smi()
    if smi is not None:  # clocks right after the load
        results["environment"]["nvidia_smi_after"] = smi
    results["environment"]["seconds"] = round(time.perf_counter() - t0, 2)
    path.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {path}")
    return results


if __name__ == "__main__":
    main()
