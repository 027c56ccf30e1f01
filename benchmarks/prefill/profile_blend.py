"""Profile and time blend vs full prefill on the embedded model, fp32 and bf16, interleaved.

    .venv/bin/python benchmarks/prefill/profile_blend.py --limit 3 --repeats 3 --profile bfloat16

For each question, each dtype (and each ``--row-attention`` choice) and each mode (full, blend)
is timed ``repeats`` times in an interleaved order, so a shared machine's load hits every
variant alike; it prints medians per variant and the median over questions of full/blend.
``--profile DTYPE`` adds a torch.profiler table of one blend prefill per variant of that dtype
(top ops by self CPU time).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ragblend import BlendConfig, BlendEngine
from ragblend.bench.datasets import DEV_DATASET, load_cases


def ttft_ms(engine: BlendEngine, prompt, mode: str) -> float:
    t0 = time.perf_counter()
    engine.prefill(prompt, mode)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default=str(DEV_DATASET))
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--modes", default="full,blend")
    ap.add_argument(
        "--row-attention",
        default="auto",
        help="comma-separated BlendConfig.row_attention choices to compare (auto/native/sdpa)",
    )
    ap.add_argument("--profile", default=None, help="dtype to profile one blend prefill in")
    ap.add_argument("--rows", type=int, default=25, help="profile table rows")
    args = ap.parse_args()

    choices = args.row_attention.split(",")
    engines = {}
    for d in args.dtypes.split(","):
        engine = BlendEngine.from_pretrained("embedded", config=BlendConfig(dtype=d))
        for choice in choices:
            name = d if len(choices) == 1 else f"{d}/{choice}"
            engines[name] = engine.with_config(row_attention=choice)
    cases = load_cases(
        args.dataset,
        next(iter(engines.values())).tokenizer,
        args.top_k,
        args.chunk_tokens,
        args.limit,
    )
    modes = args.modes.split(",")
    times: dict[tuple[str, str], list[float]] = {(d, m): [] for d in engines for m in modes}
    ratios: dict[str, list[float]] = {d: [] for d in engines}
    for case in cases:
        prompts = {}
        for d, engine in engines.items():
            engine.precompute(case.chunks)
            prompts[d] = engine.tokenize(case.question, case.chunks)
            for m in modes:  # warm-up
                engine.prefill(prompts[d], m)
        per_q: dict[tuple[str, str], list[float]] = {k: [] for k in times}
        for _ in range(args.repeats):
            for d, engine in engines.items():
                for m in modes:
                    per_q[(d, m)].append(ttft_ms(engine, prompts[d], m))
        for k, xs in per_q.items():
            times[k].append(statistics.median(xs))
        for d in engines:
            if "full" in modes and "blend" in modes:
                ratios[d].append(
                    statistics.median(per_q[(d, "full")]) / statistics.median(per_q[(d, "blend")])
                )
        print(
            f"{len(prompts[d].ids)} tokens: "
            + ", ".join(f"{d}/{m} {statistics.median(xs):.0f} ms" for (d, m), xs in per_q.items())
        )
    print(f"threads {torch.get_num_threads()}, {len(cases)} questions, medians over questions:")
    for (d, m), xs in times.items():
        print(f"  {d:<9} {m:<6} {statistics.median(xs):8.0f} ms")
    for d, rs in ratios.items():
        if rs:
            print(f"  {d:<9} full/blend {statistics.median(rs):.2f}x")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name, engine in engines.items():
            if name.split("/")[0] != args.profile:
                continue
            prompt = engine.tokenize(cases[0].question, cases[0].chunks)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                engine.prefill(prompt, "blend")
            print(f"{name} ({engine.row_attention} row attention), one blend prefill:")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
