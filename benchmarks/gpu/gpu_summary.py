"""The table of a ``benchmarks/gpu_check.sh`` run: its measurements beside the GPU issue's targets.

Reads what the check wrote (``gpu_bench.py``'s ``bench_<shape>.json``, ``gpu_decode.json``,
``gpu_profile.json``) and prints a Markdown summary (also written to ``--out``): per shape and
layout the TTFT of full, reuse and blend per tier and their speed-up over full, the decode
rates at 1 and 8 streams, the profiler's launches and syncs per mode, and each target with
``met`` / ``not met`` (``n/a`` for a smoke run on a CPU, whose tiny shape says nothing of a
GPU's speed).

    python benchmarks/gpu/gpu_summary.py --dir OUT --out OUT/summary.md [--smoke]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# (what, layout, variant, key, comparison, bound): the targets at 7B
RAM, DEVICE = "blend r=0.15 [ram]", "blend r=0.15 [device]"
TTFT_TARGETS = [
    ("blend r=0.15, pinned RAM: TTFT", "6x512", RAM, "ttft_ms_median", "<=", 25.0),
    ("blend r=0.15, pinned RAM: × full", "6x512", RAM, "speedup_vs_full", ">=", 3.5),
    ("blend r=0.15, KV on the GPU: TTFT", "6x512", DEVICE, "ttft_ms_median", "<=", 20.0),
    ("reuse, KV on the GPU: TTFT", "6x512", "reuse [device]", "ttft_ms_median", "<=", 8.0),
    ("blend r=0.15, RAM, 12×512: × full", "12x512", RAM, "speedup_vs_full", ">=", 5.0),
]
AUTO_FLOOR = 0.95  # blend ratio="auto" against full, on every tier
DECODE_ONE_STREAM = 120.0  # tok/s, Mistral-7B shape
DECODE_EIGHT_RATIO = 5.0


def load(path: Path) -> dict[str, Any] | None:
    """The JSON at ``path``, or None when the step that writes it did not run or failed."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def verdict(value: float | None, comparison: str, bound: float, smoke: bool) -> str:
    if smoke:
        return "n/a (smoke)"
    if value is None:
        return "missing"
    ok = value <= bound if comparison == "<=" else value >= bound
    return "met" if ok else "not met"


def ttft_tables(bench: dict[str, Any]) -> list[str]:
    lines = []
    for shape, model in bench.get("models", {}).items():
        for layout, entry in model.get("layouts", {}).items():
            lines += [
                f"\n**{shape}, {layout}** ({entry.get('prompt_tokens', '?')} prompt tokens)\n",
                "| variant | TTFT ms | × full | recomputed |",
                "|---|---:|---:|---:|",
            ]
            for name, v in entry.get("variants", {}).items():
                recomputed = v.get("recomputed_fraction")
                lines.append(
                    f"| {name} | {v['ttft_ms_median']:.1f} | {v['speedup_vs_full']:.2f}× | "
                    + ("" if recomputed is None else f"{recomputed:.3f}")
                    + " |"
                )
    return lines


def target_rows(benches: dict[str, dict[str, Any]], decode: dict | None, smoke: bool) -> list[str]:
    rows = ["| target | shape | measured | bound | verdict |", "|---|---|---:|---:|---|"]
    for shape, bench in benches.items():
        layouts = bench.get("models", {}).get(shape, {}).get("layouts", {})
        for what, layout, variant, key, comparison, bound in TTFT_TARGETS:
            variants = layouts.get(layout, {}).get("variants", {})
            for suffix in ("", " fused"):  # HF's layer modules, then the fused steps if timed
                v = variants.get(variant + suffix)
                if suffix and v is None:
                    continue
                value = None if v is None else float(v[key])
                shown = "—" if value is None else f"{value:.2f}"
                check = verdict(value, comparison, bound, smoke)
                rows.append(
                    f"| {what}{suffix} | {shape} | {shown} | {comparison} {bound} | {check} |"
                )
        for layout, entry in layouts.items():
            for name, v in entry.get("variants", {}).items():
                if v.get("ratio") == "auto":
                    value = float(v["speedup_vs_full"])
                    check = verdict(value, ">=", AUTO_FLOOR, smoke)
                    rows.append(
                        f"| {name} × full, {layout} | {shape} | {value:.2f} | >= {AUTO_FLOOR} "
                        f"| {check} |"
                    )
    for shape, result in (decode or {}).get("shapes", {}).items():
        graph = result.get("graph")
        steps = [("", result.get("batches", {}))]
        if graph is not None:  # the pool's CUDA-graph step, if it was captured
            active = "" if graph.get("cuda_graphs_active") else ", capture failed: eager"
            steps.append((f" (CUDA graph{active})", graph.get("batches", {})))
        for label, batches in steps:
            one = batches.get("1", {}).get("tokens_per_s")
            eight = batches.get("8", {}).get("ratio")
            for what, value, bound in (
                ("decode, 1 stream, tok/s", one, DECODE_ONE_STREAM),
                ("decode, 8 streams / 1", eight, DECODE_EIGHT_RATIO),
            ):
                shown = "—" if value is None else f"{value:.2f}"
                check = verdict(value, ">=", bound, smoke)
                rows.append(f"| {what}{label} | {shape} | {shown} | >= {bound} | {check} |")
    return rows


def profile_rows(profile: dict[str, Any]) -> list[str]:
    rows = [
        "| shape | mode | wall ms | host ms (ops) | device kernel ms | launches | syncs (runtime"
        " / ops) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for shape, result in profile.get("shapes", {}).items():
        for mode, m in result.get("modes", {}).items():
            syncs = m.get("syncs", {})
            launches = m.get("kernel_launches", {}).get("count", "?")
            rows.append(
                f"| {shape} | {mode} | {m.get('wall_ms', 0):.1f} | {m.get('host_ms', 0):.1f} | "
                f"{m.get('device_kernel_ms', 0):.1f} | {launches} | "
                f"{syncs.get('runtime_total', '?')} / {syncs.get('op_total', '?')} |"
            )
    return rows


def summarize(directory: Path, smoke: bool) -> str:
    benches = {
        p.stem.removeprefix("bench_"): data
        for p in sorted(directory.glob("bench_*.json"))
        if (data := load(p)) is not None
    }
    decode = load(directory / "gpu_decode.json")
    profile = load(directory / "gpu_profile.json")
    lines = ["# gpu_check.sh" + (" --smoke (CPU, tiny shape)" if smoke else ""), ""]
    device = next(
        (b.get("environment", {}).get("device_name") for b in benches.values() if b), None
    )
    if device:
        lines.append(f"Device: {device}")
    lines += ["", "## Targets", "", *target_rows(benches, decode, smoke)]
    lines += ["", "## TTFT per variant (medians)"]
    for bench in benches.values():
        lines += ttft_tables(bench)
    if decode is not None:
        lines += ["", "## Decode", "", "| shape | streams | ms/step | tok/s | × one |"]
        lines.append("|---|---:|---:|---:|---:|")
        for shape, result in decode.get("shapes", {}).items():
            for b, r in result.get("batches", {}).items():
                lines.append(
                    f"| {shape} | {b} | {r.get('ms_per_step', 0):.2f} | "
                    f"{r.get('tokens_per_s', 0):.1f} | {r.get('ratio', 1.0):.2f} |"
                )
    if profile is not None:
        lines += ["", "## One prefill under the profiler", "", *profile_rows(profile)]
    missing = [
        name
        for name, found in (
            ("gpu_bench", benches),
            ("gpu_decode", decode),
            ("gpu_profile", profile),
        )
        if not found
    ]
    if missing:
        lines += [
            "",
            f"Missing (the step failed or did not run; see the log): {', '.join(missing)}",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="the folder gpu_check.sh wrote")
    ap.add_argument("--out", default=None, help="write the summary here too")
    ap.add_argument("--smoke", action="store_true", help="a CPU smoke run: targets are n/a")
    args = ap.parse_args(argv)
    text = summarize(Path(args.dir), args.smoke)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
