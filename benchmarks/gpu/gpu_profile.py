"""One prefill per mode under torch.profiler: host time, kernel time, launches and syncs.

For each model shape (``ragblend.bench.shapes``; random weights built on the device, driven
with token ids only) the engine is built as ``gpu_bench.py`` builds it
(``ragblend.bench.gpu_shape``): the ``--layout`` chunks precomputed, then held in a RAM store (on
CUDA: copies in pinned host memory, gpu_shape's ``ram`` tier; layers loaded on the calling
thread). Per mode, after
``--warmup`` unprofiled prefills: the median wall time of ``--repeats`` unprofiled prefills
(``perf_counter`` with ``torch.cuda.synchronize()`` before and after on CUDA), then ONE
prefill under ``torch.profiler.profile`` (CPU activity, and CUDA on CUDA), inside a
``record_function("ragblend::prefill")`` range: host events are counted inside that range
(any thread), so the profiler's own synchronize at its exit is not; device events are all of
the profile's.

Reported per mode:

* ``wall_ms`` (unprofiled median), ``profiled_wall_ms``;
* ``host_ms``: CPU time of the top-level ops (ops with no op above them) and
  ``host_outside_ops_ms``: the prefill range's CPU time outside any op (Python);
* ``device_kernel_ms``: the CUDA kernel events' device time (0 on CPU), beside it memcpy /
  memset device time and the kernel count;
* ``kernel_launches``: on CUDA the launch runtime calls (``cudaLaunchKernel``,
  ``cudaLaunchKernelExC``, ``cuLaunchKernel``, ``cuLaunchKernelEx``; a trailing ``_vNNNN`` is
  ignored); on CPU, as a stand-in, the leaf aten/custom op events that would launch a kernel
  (not views, allocations or metadata queries: ``ragblend.bench.op_kinds.NON_KERNEL_OPS``),
  ``source`` says which;
* ``syncs``: counts per name of ``cudaStreamSynchronize``, ``cudaDeviceSynchronize``,
  ``cudaEventSynchronize``, ``cudaMemcpy`` (not ``…Async``) and the op events
  ``aten::_local_scalar_dense`` / ``aten::nonzero`` (``runtime_total``, ``op_total``; an
  ``item()`` on CUDA shows in both);
* ``top_ops``: the ``--top`` ops by self host time (name, count, self CPU ms, self device ms).

Writes ``OUT/gpu_profile.json`` (and, with ``--trace``, ``OUT/trace_<shape>_<mode>.json``,
or ``OUT/trace_<mode>.json`` for a single shape)::

    {"shapes": {"<shape>": {"device", "dtype", "layout", "prompt_tokens", "ratio",
                            "modes": {"full": {"wall_ms", "profiled_wall_ms", "host_ms",
                                               "device_kernel_ms", "kernel_launches",
                                               "syncs", "top_ops", ...}, ...}}},
     "settings": {...}, "environment": {...}}

    python benchmarks/gpu/gpu_profile.py --shape mistral-7b --device cuda --out out/gpu_profile
    OMP_NUM_THREADS=1 python benchmarks/gpu/gpu_profile.py --shape tiny --device cpu --out /tmp/gp
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run from a checkout without an installed ragblend
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from ragblend.bench.environment import environment, nvidia_smi  # noqa: E402
from ragblend.bench.harness import peak_memory, resolve_device, sync  # noqa: E402
from ragblend.bench.shapes import SHAPES, pinned, random_ids, shape_engine  # noqa: E402
from ragblend.prompt import TokenizedPrompt  # noqa: E402
from ragblend.store.base import ChunkKV  # noqa: E402
from ragblend.store.memory import MemoryStore  # noqa: E402

try:  # what would launch no kernel on a GPU (views, allocations, metadata)
    from ragblend.bench.op_kinds import NON_KERNEL_OPS, SYNC_ONLY_OPS

    NON_KERNEL = frozenset(p._qualified_op_name for p in NON_KERNEL_OPS | SYNC_ONLY_OPS)
except (ImportError, AttributeError):  # pragma: no cover - a torch without the names
    NON_KERNEL = frozenset()
# Composite ops that, seen as leaves, did nothing (a no-op ``to``, ``contiguous``, conj/neg
# resolution of a plain tensor): no kernel either.
NON_KERNEL |= {
    "aten::to",
    "aten::contiguous",
    "aten::resolve_conj",
    "aten::resolve_neg",
    "aten::type_as",
    "aten::item",
    "aten::result_type",
    "aten::as_strided_",
}

DTYPES = ("bfloat16", "float16", "float32")
MODES = ("full", "prefix", "reuse", "blend")
FULL_DEFAULTS = dict(layout="6x512", head_tokens=48, question_tokens=32)
TINY_DEFAULTS = dict(layout="3x48", head_tokens=16, question_tokens=8)
RANGE = "ragblend::prefill"
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
RUNTIME_SYNCS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
)
OP_SYNCS = ("aten::_local_scalar_dense", "aten::nonzero")
RUNTIME_KINDS = ("cuda_runtime", "cuda_driver")
_VERSION = re.compile(r"_v\d+$")  # CUPTI names some runtime calls e.g. cudaLaunchKernel_v7000


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
        "--dtype", default=None, choices=DTYPES, help="default bfloat16 on CUDA, else fp32"
    )
    ap.add_argument("--layout", default=None, help="chunks x tokens (default 6x512; tiny: 3x48)")
    ap.add_argument("--head-tokens", type=int, default=None, help="default 48; tiny: 16")
    ap.add_argument("--question-tokens", type=int, default=None, help="default 32; tiny: 8")
    ap.add_argument("--separator-tokens", type=int, default=1, help="between chunks (default 1)")
    ap.add_argument("--modes", default="full,reuse,blend", help="default full,reuse,blend")
    ap.add_argument(
        "--ratio", type=float, default=None, help="blend recompute ratio (default: the config's)"
    )
    ap.add_argument("--warmup", type=int, default=1, help="unprofiled prefills first (default 1)")
    ap.add_argument(
        "--repeats", type=int, default=3, help="unprofiled timed prefills per mode (default 3)"
    )
    ap.add_argument(
        "--fused",
        action="store_true",
        help="also profile reuse and blend with layer_kernels='fused' ('reuse fused', "
        "'blend fused': the Triton layer steps on CUDA)",
    )
    ap.add_argument("--top", type=int, default=12, help="ops in the top table (default 12)")
    ap.add_argument("--trace", action="store_true", help="write a Chrome trace per mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default="out/gpu_profile", help="output directory (default out/gpu_profile)"
    )
    args = ap.parse_args(argv)
    shapes = [s.strip() for v in (args.shape or ["mistral-7b"]) for s in v.split(",")]
    args.shapes = list(dict.fromkeys(s for s in shapes if s))
    for s in args.shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; expected some of {', '.join(SHAPES)}")
    defaults = TINY_DEFAULTS if args.shapes == ["tiny"] else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        k, n = (int(v) for v in args.layout.lower().split("x"))
    except ValueError:
        ap.error(f"--layout: expected KxN, got {args.layout!r}")
    if k < 1 or n < 1 or args.head_tokens < 1 or args.warmup < 0 or args.repeats < 1:
        ap.error("--layout KxN >= 1x1, --head-tokens >= 1, --warmup >= 0, --repeats >= 1")
    args.chunks, args.chunk_tokens = k, n
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in args.mode_list:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; expected some of {', '.join(MODES)}")
    return args


# ------------------------------------------------------------------ profiler events
def _attr(obj, *names, default=0.0):
    """The first of ``names`` that ``obj`` has (profiler attributes renamed across torch
    versions: ``device_time`` / ``cuda_time``, ``self_device_time_total`` / ...)."""
    for name in names:
        try:
            value = getattr(obj, name)
        except (AttributeError, AssertionError, RuntimeError):
            continue
        if value is not None:
            return value
    return default


def _name(e) -> str:
    return _VERSION.sub("", str(e.name))


def _kind(e) -> str:
    return str(getattr(e, "activity_type", "") or "").lower()


def _on_device(e) -> bool:
    return getattr(e, "device_type", None) not in (None, torch.autograd.DeviceType.CPU)


def _span(e) -> tuple[float, float]:
    return float(e.time_range.start), float(e.time_range.end)


def _is_runtime(e) -> bool:
    kind = _kind(e)
    if kind:
        return kind in RUNTIME_KINDS
    name = _name(e)
    return "::" not in name and (name.startswith("cuda") or name.startswith("cu"))


def _is_op(e) -> bool:
    kind = _kind(e)
    if kind:
        return kind == "cpu_op"
    return "::" in str(e.name) and str(e.name) != RANGE


def _device_category(e) -> str:
    """kernel, memcpy, memset or other (annotations, syncs) for a device event."""
    kind, name = _kind(e), str(e.name)
    if kind in ("kernel", "gpu_memcpy", "gpu_memset"):
        return {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}[kind]
    if kind:
        return "other"
    if name.startswith("Memcpy"):
        return "memcpy"
    if name.startswith("Memset"):
        return "memset"
    return "other" if name == RANGE else "kernel"


def _device_us(e) -> float:
    try:
        return float(e.time_range.elapsed_us())
    except AttributeError:  # pragma: no cover - older FunctionEvent
        return float(_attr(e, "device_time_total", "cuda_time_total"))


def summarize(prof, device: torch.device, top: int) -> dict:
    """The counts of one profiled prefill (see the module docstring)."""
    events = list(prof.events())
    ranges = [e for e in events if str(e.name) == RANGE and not _on_device(e)]
    if not ranges:
        raise RuntimeError(f"the profile has no {RANGE} range")
    marker = ranges[0]
    lo, hi = _span(marker)
    host = [
        e
        for e in events
        if e is not marker
        and not _on_device(e)
        and not getattr(e, "is_async", False)
        and lo <= _span(e)[0]
        and _span(e)[1] <= hi
    ]
    ops = [e for e in host if _is_op(e)]
    op_ids = {id(e) for e in ops}

    def top_level(e) -> bool:
        parent = getattr(e, "cpu_parent", None)
        while parent is not None:
            if id(parent) in op_ids:
                return False
            parent = getattr(parent, "cpu_parent", None)
        return True

    tops = [e for e in ops if top_level(e)]
    host_us = sum(float(_attr(e, "cpu_time_total")) for e in tops)
    on_cuda = device.type == "cuda"

    device_us: Counter[str] = Counter()
    device_n: Counter[str] = Counter()
    for e in events:
        if _on_device(e):
            cat = _device_category(e)
            device_us[cat] += _device_us(e)
            device_n[cat] += 1

    names = Counter(_name(e) for e in host)
    if on_cuda:
        launches = {n: names[n] for n in LAUNCHES}
        launch = {
            "count": sum(launches.values()),
            "by_name": launches,
            "source": "CUDA runtime/driver launch calls",
        }
    else:
        below: dict[int, bool] = {}  # op id -> a kernel among the ops under it

        def kernel_below(e) -> bool:
            if id(e) not in below:
                children = [c for c in getattr(e, "cpu_children", None) or [] if id(c) in op_ids]
                below[id(e)] = any([kernel(c) or kernel_below(c) for c in children])
            return below[id(e)]

        def kernel(e) -> bool:  # an op that would launch a kernel: no op under it would
            name = str(e.name)
            return "::" in name and name not in NON_KERNEL and not kernel_below(e)

        leaves = [e for e in ops if kernel(e)]
        launch = {
            "count": len(leaves),
            "by_name": dict(Counter(str(e.name) for e in leaves).most_common(top)),
            "source": "CPU stand-in: op events with no such op under them, other than "
            "views, allocations and metadata queries",
            "all_op_events": len(ops),
        }
    syncs = {n: names[n] for n in (*RUNTIME_SYNCS, *OP_SYNCS)}
    runtime_names = Counter(_name(e) for e in host if _is_runtime(e))
    other_device = Counter(
        str(e.name) for e in events if _on_device(e) and _device_category(e) == "other"
    )
    runtime_other = {
        n: c for n, c in names.items() if n.startswith("cudaMemcpy") and n not in syncs
    }

    table: dict[str, list[float]] = {}
    for e in host:
        if not (_is_op(e) or _is_runtime(e)):
            continue
        row = table.setdefault(str(e.name), [0, 0.0, 0.0])
        row[0] += 1
        row[1] += float(_attr(e, "self_cpu_time_total"))
        row[2] += float(_attr(e, "self_device_time_total", "self_cuda_time_total"))
    ranked = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "host_ms": round(host_us / 1e3, 4),
        "host_range_ms": round(float(_attr(marker, "cpu_time_total")) / 1e3, 4),
        "host_outside_ops_ms": round(float(_attr(marker, "self_cpu_time_total")) / 1e3, 4),
        "top_level_ops": len(tops),
        "device_kernel_ms": round(device_us["kernel"] / 1e3, 4),
        "device_kernels": device_n["kernel"],
        "device_memcpy_ms": round(device_us["memcpy"] / 1e3, 4),
        "device_memcpys": device_n["memcpy"],
        "device_memset_ms": round(device_us["memset"] / 1e3, 4),
        "kernel_launches": launch,
        "syncs": {
            "by_name": syncs,
            "runtime_total": sum(syncs[n] for n in RUNTIME_SYNCS),
            "op_total": sum(syncs[n] for n in OP_SYNCS),
            "other_memcpy_calls": runtime_other,
        },
        # What this torch/CUPTI build calls its events (to check the names counted above).
        "runtime_calls": dict(runtime_names.most_common(20)),
        "device_other_events": dict(other_device.most_common(10)),
        "activity_types": dict(Counter(_kind(e) or "?" for e in events)),
        "top_ops": [
            {
                "name": name,
                "count": int(row[0]),
                "self_cpu_ms": round(row[1] / 1e3, 4),
                "device_ms": round(row[2] / 1e3, 4),
            }
            for name, row in ranked
        ],
    }


# ------------------------------------------------------------------ one shape
def build_engine(shape: str, args: argparse.Namespace, device: torch.device):
    master = MemoryStore(1 << 40)
    engine, build_s = shape_engine(shape, device, args.dtype, args.seed, master)
    model = engine.model
    vocab = int(model.config.vocab_size)
    rng = random.Random(args.seed)
    head = [int(model.config.bos_token_id)] + random_ids(rng, args.head_tokens - 1, vocab)
    sep = random_ids(rng, args.separator_tokens, vocab) if args.separator_tokens else []
    chunks = [random_ids(rng, args.chunk_tokens, vocab) for _ in range(args.chunks)]
    prompt = TokenizedPrompt(head, chunks, sep, random_ids(rng, args.question_tokens, vocab))
    for c in chunks:
        engine.precompute_ids(c, head)
    sync(device)
    store = master
    if device.type == "cuda":  # the RAM tier: pinned host copies (gpu_shape's tier_stores)
        store = MemoryStore(1 << 40)
        for key in master.keys():
            kv = master.get(key)
            store.put(key, ChunkKV(pinned(kv.k, True), pinned(kv.v, True), dict(kv.meta)))
        master.clear()
        engine = engine.with_config(store=store)
    store.prefetch_depth = 0  # layers loaded on the calling thread (the RAM tier's default)
    return engine, prompt, build_s


def profile_mode(engine, prompt, mode: str, ratio, args, device: torch.device) -> tuple:
    """Warm-up and timed unprofiled prefills of ``mode``, then one profiled: (row, profile)."""

    def prefill():
        return engine.prefill(prompt, mode=mode, ratio=ratio if mode == "blend" else None)

    for _ in range(args.warmup):
        prefill()
    walls = []
    for _ in range(args.repeats):
        sync(device)
        t0 = time.perf_counter()
        prefill()
        sync(device)
        walls.append((time.perf_counter() - t0) * 1e3)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(device)
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        with record_function(RANGE):
            result = prefill()
        sync(device)  # outside the range: not counted
        profiled_ms = (time.perf_counter() - t0) * 1e3
    row = {
        "wall_ms": round(statistics.median(walls), 4),
        "wall_ms_repeats": [round(w, 4) for w in walls],
        "profiled_wall_ms": round(profiled_ms, 4),
        "ran_mode": result.stats.mode,
        "fallback_reason": getattr(result.stats, "fallback_reason", None),
        **summarize(prof, device, args.top),
    }
    return row, prof


def run_shape(shape: str, args: argparse.Namespace, device: torch.device, out: Path) -> dict:
    engine, prompt, build_s = build_engine(shape, args, device)
    ratio = args.ratio if args.ratio is not None else engine.config.ratio
    info: dict = {
        "device": str(device),
        "dtype": args.dtype,
        "layout": f"{args.chunks}x{args.chunk_tokens}",
        "prompt_tokens": len(prompt),
        "ratio": ratio,
        "row_attention": getattr(engine, "row_attention", None),
        "build_s": round(build_s, 3),
        "modes": {},
    }
    print(f"[{shape}] built in {build_s:.1f}s, {len(prompt)}-token prompt", flush=True)
    for mode in args.mode_list:
        row, prof = profile_mode(engine, prompt, mode, ratio, args, device)
        if args.trace:
            name = f"trace_{mode}.json" if len(args.shapes) == 1 else f"trace_{shape}_{mode}.json"
            prof.export_chrome_trace(str(out / name))
            row["trace"] = name
        info["modes"][mode] = row
        del prof
    if args.fused:  # the same prompt through the fused layer steps
        fused = engine.with_config(layer_kernels="fused")
        for mode in (m for m in args.mode_list if m in ("reuse", "blend")):
            row, prof = profile_mode(fused, prompt, mode, ratio, args, device)
            row["layer_kernels"] = getattr(fused.layer_kernels, "impl", None)
            info["modes"][f"{mode} fused"] = row
            del prof
        del fused
    del engine
    gc.collect()
    peak = peak_memory(device)
    if peak is not None:
        info["max_memory_allocated_bytes"] = peak
    return info


def print_summary(shape: str, info: dict) -> None:
    print(
        f"\n{shape} ({info['dtype']}, {info['layout']}, {info['prompt_tokens']} tokens, "
        f"{info['device']})"
    )
    print(
        f"  {'mode':>11} {'wall ms':>9} {'prof ms':>9} {'host ms':>9} {'kernel ms':>10} "
        f"{'launches':>9} {'syncs rt/op':>12}  top op (self CPU ms)"
    )
    for mode, row in info["modes"].items():
        top = row["top_ops"][0] if row["top_ops"] else {"name": "-", "self_cpu_ms": 0.0}
        syncs = f"{row['syncs']['runtime_total']}/{row['syncs']['op_total']}"
        ran = "" if row["ran_mode"] == mode.split()[0] else f" (ran {row['ran_mode']})"
        print(
            f"  {mode:>11} {row['wall_ms']:>9.2f} {row['profiled_wall_ms']:>9.2f} "
            f"{row['host_ms']:>9.2f} {row['device_kernel_ms']:>10.2f} "
            f"{row['kernel_launches']['count']:>9} {syncs:>12}  "
            f"{top['name']} ({top['self_cpu_ms']:.2f}){ran}"
        )
    first = next(iter(info["modes"].values()), None)
    if first is not None:
        print(f"  launches: {first['kernel_launches']['source']}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = resolve_device(args.device, "gpu_profile.py")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if args.dtype is None:
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {
        "shapes": {},
        "settings": {k: v for k, v in vars(args).items() if k not in ("shape", "mode_list")},
        "environment": environment(device),
    }
    path = out / "gpu_profile.json"
    t0 = time.perf_counter()
    for shape in args.shapes:
        results["shapes"][shape] = run_shape(shape, args, device, out)
        print_summary(shape, results["shapes"][shape])
        path.write_text(json.dumps(results, indent=2, default=str))
    smi = nvidia_smi()
    if smi is not None:
        results["environment"]["nvidia_smi_after"] = smi
    results["environment"]["seconds"] = round(time.perf_counter() - t0, 2)
    path.write_text(json.dumps(results, indent=2, default=str))
    print(f"\nwrote {path}")
    return results


if __name__ == "__main__":
    main()
