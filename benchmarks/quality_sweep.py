"""Selection options × ratio against full prefill (issue 14), same protocol as sweep.py.

Every variant runs on the same questions, interleaved, scored by fidelity to full prefill
(``ragblend.bench.fidelity``: teacher-forced answer KL over full prefill's greedy answer,
first-token KL, exact greedy agreement) and TTFT speedup (median of per-question ratios of
tokenize + prefill time). Writes ``OUT/quality_sweep.{json,png,md}`` after every question: the
table with KL relative to full KV reuse, and answer KL / reuse vs speedup with the Pareto front.

Exact greedy agreement is stricter than sweep.py's normalised-text agreement. The answers are
decoded, and teacher-forced, with exact activations (``--decode-activations float``, the default
here), so every KL is the prefill's error alone. The grids of 2026-11-27 ran with ``auto``
(llama.cpp's 8-bit activations on AVX2) and a batched teacher-forced forward, which rounded
differently from the decode: full prefill disagreed with its own answer on a fifth of the
questions.

    python benchmarks/quality_sweep.py --dataset ../shared/data/musique_dev.json \\
        --offset 20 --limit 20 --out benchmarks/results/intel-amx
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ragblend.bench import study
from ragblend.bench.fidelity import measure_case, summarize
from ragblend.bench.harness import Variant
from ragblend.bench.metrics import add_decode_activations_argument
from ragblend.config import fold_selection

RELEVANCE_KV = {"selector": "relevance-kv"}
CHUNK_KV = {"selector": "chunk-kv"}
STARTS = {"chunk_start_tokens": 16}
HOT = {"cached_temperature": 1.1}
# the defaults before issue 54, on an engine with OPTIONS_OFF
BEFORE = Variant(
    "kv T=1.06 r=0.15 (defaults before)", "blend", {"ratio": 0.15, "cached_temperature": 1.06}
)
FIRST = {"exact_first_chunk": True}
REUSE_FIRST = Variant("reuse, exact first chunk", "reuse", FIRST)
CURVE_RATIOS = (0.05, 0.1, 0.15, 0.2, 0.3, 0.4)
OPTIONS_OFF = {
    "cached_temperature": 1.0,
    "chunk_start_tokens": 0,
    "near_question_tokens": 0,
    "check_scales": (1.5, 0.7),
    "exact_first_chunk": False,
}


def variants(which: str) -> list[Variant]:
    """The grid: baselines, then each option alone, then combinations."""
    out = [Variant("full", "full"), Variant("reuse", "reuse")]
    if which == "smoke":
        return out + [Variant("kv r=0.15", "blend", {"ratio": 0.15})]
    if which == "baselines":  # full and reuse alone (e.g. reuse of isolated caches)
        return out
    r = 0.15
    if which == "curve":  # the defaults' selection at every ratio (issue 54)
        return out + [
            BEFORE,
            *(
                Variant(f"defaults r={ratio}", "blend", {**default_selection(), "ratio": ratio})
                for ratio in CURVE_RATIOS
            ),
        ]
    if which == "curve_first_chunk":  # the curve again with the first chunk's exact entry
        return out + [REUSE_FIRST, *(first_chunk_blend(ratio) for ratio in CURVE_RATIOS)]
    if which == "defaults":  # today's defaults against the ones before issue 54
        return out + [
            BEFORE,
            Variant("defaults r=0.15", "blend", {**default_selection(), "ratio": r}),
        ]
    if which == "first_chunk":  # the first chunk's exact entry (exact_first_chunk, issue 54)
        return out + [
            REUSE_FIRST,
            Variant("defaults r=0.15", "blend", {**default_selection(), "ratio": r}),
            first_chunk_blend(0.15),
            first_chunk_blend(0.18),
        ]
    # today's defaults at r = 0.15, the first chunk's exact entry included
    first_chunk_defaults = {**default_selection(), **FIRST, "ratio": r}
    if which == "neighbour_count":  # one run per --precompute-neighbours (the caches differ)
        return out + [REUSE_FIRST, first_chunk_blend(r)]
    if which == "layers":  # a per-layer budget: more check layers at about the same cost
        schedules = {
            "(1,10) 1.5/1.0": ((1, 10), (1.5, 1.0)),  # the defaults
            "(1,10,20) 1.5/1.1/0.9": ((1, 10, 20), (1.5, 1.1, 0.9)),
            "(1,10,20) 1.5/1.0/0.8": ((1, 10, 20), (1.5, 1.0, 0.8)),
            "(1,5,10) 1.8/1.4/1.0": ((1, 5, 10), (1.8, 1.4, 1.0)),
            "(1,5,10,20) 1.8/1.4/1.1/0.9": ((1, 5, 10, 20), (1.8, 1.4, 1.1, 0.9)),
            "(1,15) 1.3/0.9": ((1, 15), (1.3, 0.9)),
        }
        return out + [
            Variant(
                f"exact first chunk, check {name} r=0.15",
                "blend",
                {**first_chunk_defaults, "check_layers": layers, "check_scales": scales},
            )
            for name, (layers, scales) in schedules.items()
        ]
    if which == "query":  # the query-driven selectors on reused neighbour caches (issue 54)
        return out + [
            Variant("exact first chunk, kv-deviation r=0.15", "blend", first_chunk_defaults),
            Variant(
                "exact first chunk, relevance-kv r=0.15",
                "blend",
                {**first_chunk_defaults, **RELEVANCE_KV},
            ),
            Variant(
                "exact first chunk, relevance r=0.15",
                "blend",
                {**first_chunk_defaults, "selector": "relevance"},
            ),
            Variant(
                "exact first chunk, relevance-kv near128 r=0.15",
                "blend",
                {**first_chunk_defaults, **RELEVANCE_KV, "near_question_tokens": 128},
            ),
        ]

    def each(label: str, option: str, values: tuple) -> list[Variant]:
        """The defaults, then ``option`` set to each of ``values`` on top of them."""
        return [
            Variant("exact first chunk r=0.15", "blend", first_chunk_defaults),
            *(
                Variant(
                    f"exact first chunk, {label} {v} r=0.15",
                    "blend",
                    {**first_chunk_defaults, option: v},
                )
                for v in values
            ),
        ]

    if which == "near":  # more of the rows before the question kept (the first token's error)
        return [
            *out,
            *each("near", "near_question_tokens", (384, 512)),
            Variant("exact first chunk r=0.18", "blend", {**first_chunk_defaults, "ratio": 0.18}),
        ]
    if which == "fitted":  # chunks precomputed after their prompt predecessor: recompute less
        return out + each("fitted weight", "fitted_chunk_weight", (0.0, 0.25, 0.5))
    if which == "neighbours":  # selection policies re-run on neighbour-aware caches (issue 54)
        return out + [
            Variant("kv T=1.06 r=0.15", "blend", {"ratio": r, "cached_temperature": 1.06}),
            Variant("kv r=0.15", "blend", {"ratio": r}),
            Variant("kv+starts16 r=0.15", "blend", {"ratio": r, **STARTS}),
            Variant("kv+near128 r=0.15", "blend", {"ratio": r, "near_question_tokens": 128}),
            Variant("kv+near256 r=0.15", "blend", {"ratio": r, "near_question_tokens": 256}),
            Variant(
                "kv+starts16+near128 r=0.15",
                "blend",
                {"ratio": r, **STARTS, "near_question_tokens": 128},
            ),
            Variant("chunk-kv r=0.15", "blend", {"ratio": r, **CHUNK_KV}),
            Variant(
                "kv+near128 T=1.06 r=0.15",
                "blend",
                {"ratio": r, "near_question_tokens": 128, "cached_temperature": 1.06},
            ),
        ]
    if which == "neighbours2":  # around the first grid's best: starts × near-question rows
        near = "near_question_tokens"
        return out + [
            Variant("kv+starts16+near128 r=0.15", "blend", {"ratio": r, **STARTS, near: 128}),
            Variant("kv+starts16+near256 r=0.15", "blend", {"ratio": r, **STARTS, near: 256}),
            Variant(
                "kv+starts32+near128 r=0.15",
                "blend",
                {"ratio": r, "chunk_start_tokens": 32, near: 128},
            ),
            Variant(
                "kv+starts16+near128 scales 1.5/1.0 r=0.15",
                "blend",
                {"ratio": r, **STARTS, near: 128, "check_scales": (1.5, 1.0)},
            ),
            Variant(
                "kv+starts16+near256 scales 1.5/1.0 r=0.15",
                "blend",
                {"ratio": r, **STARTS, near: 256, "check_scales": (1.5, 1.0)},
            ),
            Variant("kv+starts16+near256 r=0.2", "blend", {"ratio": 0.2, **STARTS, near: 256}),
        ]
    if which == "temperature":  # the cached-row temperature alone, around the grid's T=1.1
        return out + [
            Variant("kv r=0.15", "blend", {"ratio": r}),
            *(
                Variant(f"kv T={t} r=0.15", "blend", {"ratio": r, "cached_temperature": t})
                for t in (1.03, 1.06, 1.1)  # 1.06 became the default from this grid
            ),
        ]
    if which == "followup":  # temperature × relevance, after the grid's best two options
        return out + [
            Variant("kv r=0.15", "blend", {"ratio": r}),
            Variant("kv T=1.2 r=0.15", "blend", {"ratio": r, "cached_temperature": 1.2}),
            Variant("kv T=1.3 r=0.15", "blend", {"ratio": r, "cached_temperature": 1.3}),
            Variant("relevance-kv T=1.1 r=0.15", "blend", {"ratio": r, **RELEVANCE_KV, **HOT}),
            Variant(
                "relevance-kv T=1.2 r=0.15",
                "blend",
                {"ratio": r, **RELEVANCE_KV, "cached_temperature": 1.2},
            ),
            Variant(
                "relevance-kv+starts16 T=1.1 r=0.15",
                "blend",
                {"ratio": r, **RELEVANCE_KV, **STARTS, **HOT},
            ),
            Variant("relevance-kv T=1.1 r=0.1", "blend", {"ratio": 0.1, **RELEVANCE_KV, **HOT}),
        ]
    out += [
        Variant("kv r=0.15", "blend", {"ratio": r}),
        Variant("kv r=0.25", "blend", {"ratio": 0.25}),
        Variant("starts16 only (r=0)", "blend", {"ratio": 0.0, **STARTS}),
        Variant("kv+starts16 r=0.15", "blend", {"ratio": r, **STARTS}),
        Variant("relevance r=0.15", "blend", {"ratio": r, "selector": "relevance"}),
        Variant("relevance-kv r=0.15", "blend", {"ratio": r, **RELEVANCE_KV}),
        Variant("relevance-kv+starts16 r=0.15", "blend", {"ratio": r, **RELEVANCE_KV, **STARTS}),
        Variant("relevance-kv+starts16 r=0.1", "blend", {"ratio": 0.1, **RELEVANCE_KV, **STARTS}),
        Variant("kv T=0.9 r=0.15", "blend", {"ratio": r, "cached_temperature": 0.9}),
        Variant("kv T=1.1 r=0.15", "blend", {"ratio": r, "cached_temperature": 1.1}),
        Variant(
            "kv adaptive 0.4 [.05,.3]",
            "blend",
            {"ratio": r, "adaptive_mass": 0.4, "adaptive_ratio": (0.05, 0.3)},
        ),
    ]
    return out


def first_chunk_blend(ratio: float) -> Variant:
    """Blend at ``ratio`` with the default selection and the first chunk's exact entry."""
    return Variant(
        f"defaults, exact first chunk r={ratio}",
        "blend",
        {**default_selection(), **FIRST, "ratio": ratio},
    )


def default_selection() -> dict:
    """BlendConfig's selection options at their defaults (the engine here runs with T = 1)."""
    from ragblend.config import BlendConfig

    base = BlendConfig()
    keys = (
        "selector",
        "chunk_start_tokens",
        "near_question_tokens",
        "check_layers",
        "check_scales",
    )
    levers = ("cached_temperature", "fitted_chunk_weight")
    return {
        **{k: getattr(base, k) for k in keys},
        **{k: getattr(base.selection, k) for k in levers},
    }


def table(results: dict) -> str:
    """Markdown table: speedup, recomputed share, KL and KL relative to reuse, agreement."""
    modes, speedup = results["modes"], results["speedup_vs_full"]
    reuse = modes["reuse"]
    lines = [
        "| variant | speedup | recomputed | answer KL | ans KL / reuse | 1st-token KL "
        "| 1st KL / reuse | agreement |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in modes.items():
        a, f = m["answer_kl_mean"], m["first_token_kl_mean"]
        lines.append(
            f"| {name} | {speedup.get(name, 1.0):.2f}× | {m['recomputed_fraction_mean']:.3f} "
            f"| {a:.4f} | {a / reuse['answer_kl_mean']:.2f} | {f:.4f} "
            f"| {f / reuse['first_token_kl_mean']:.2f} | {m['agreement_with_full']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def pareto(points: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """Points (name, speedup, KL) not beaten by another with higher speedup and lower KL."""
    front, best = [], float("inf")
    for p in sorted(points, key=lambda p: -p[1]):
        if p[2] < best:
            front.append(p)
            best = p[2]
    return front


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes, speedup = results["modes"], results["speedup_vs_full"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, key in zip(axes, ("answer_kl_mean", "first_token_kl_mean")):
        base = modes["reuse"][key]
        points = [(n, speedup[n], m[key] / base) for n, m in modes.items() if n != "full"]
        for name, x, y in points:
            marker = "^" if name == "reuse" else ("s" if name.startswith("kv r=") else "o")
            ax.scatter(x, y, marker=marker)
            ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        front = sorted(pareto(points), key=lambda p: p[1])
        ax.plot([p[1] for p in front], [p[2] for p in front], "k--", lw=0.8, label="Pareto front")
        ax.set(xlabel="TTFT speedup vs full (one run per question)", ylabel=f"{key} / reuse's")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("selection options: fidelity to full prefill vs TTFT (lower-right is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    study.add_case_arguments(ap, offset=20, limit=20)
    ap.add_argument(
        "--which",
        default="grid",
        choices=(
            "grid",
            "followup",
            "temperature",
            "neighbours",
            "neighbours2",
            "curve",
            "curve_first_chunk",
            "defaults",
            "first_chunk",
            "near",
            "layers",
            "query",
            "fitted",
            "neighbour_count",
            "baselines",
            "smoke",
        ),
    )
    ap.add_argument(
        "--precompute-context",
        default=None,
        help="how chunks are precomputed (default: the engine's, neighbour-aware; the grids "
        "before issue 54 ran with canonical)",
    )
    ap.add_argument(
        "--precompute-neighbours",
        type=int,
        default=None,
        help="neighbours per chunk for the neighbours context (default: the engine's, 2)",
    )
    ap.add_argument(
        "--skip-passages",
        type=int,
        default=0,
        help="use each case's top-k passages after the first N (another retrieval set)",
    )
    study.add_model_arguments(
        ap,
        dtype="float32",
        dtype_help="the model's dtype (default float32, not the engine's auto: the grids were "
        "tuned in fp32; bfloat16 for what a bf16 CPU runs)",
    )
    add_decode_activations_argument(ap)
    study.add_output_arguments(ap, name="quality_sweep")
    args = ap.parse_args()

    # every option off unless a variant sets it (today's defaults included: T, chunk starts,
    # rows near the question, the second check layer's scale before issue 54), so a variant's
    # name says everything it runs with
    context = {"precompute_context": args.precompute_context} if args.precompute_context else {}
    if args.precompute_neighbours is not None:
        context["precompute_neighbours"] = args.precompute_neighbours
    engine = study.engine(
        args,
        args.model,
        dtype=args.dtype,
        decode_activations=args.decode_activations,
        **context,
        **OPTIONS_OFF,
    )
    cases = study.cases(args, engine.tokenizer, skip=args.skip_passages)
    grid = variants(args.which)
    views = {v.name: engine.with_config(**fold_selection(engine.config, v.overrides)) for v in grid}
    rows: list[dict[str, dict]] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the first chunk's exact entries are stored where a variant reads them
    first = any(v.overrides.get("exact_first_chunk") for v in grid)
    precompute = engine.with_config(exact_first_chunk=True) if first else engine
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        precompute.precompute(case.chunks)
        rows.append(measure_case(engine, views, grid, case, args.max_new_tokens))
        results = summarize(rows)
        results["settings"] = {
            **vars(args),
            "precompute_context": engine.config.precompute_context,
            "precompute_neighbours": engine.config.precompute_neighbours,
            "decode_activations_resolved": engine.decode_activations,
            "n": len(rows),
            "torch_threads": torch.get_num_threads(),
        }
        study.write_outputs(out, args.name, results, table(results))
        study.question_done(i, len(cases), t0)
    plot(results, out / f"{args.name}.png")
    print(table(results))


if __name__ == "__main__":
    main()
