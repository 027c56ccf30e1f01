"""Neighbour-aware chunk caches against isolated ones (issue 34), on the bench harness.

Per question: each precompute context warms the question's chunks (timed: warmup chunks/s),
then ``ragblend.bench.harness.run_benchmark`` runs full prefill and every variant on it
(answer KL, first-token KL, greedy agreement vs full). Contexts: ``canonical`` (each chunk
alone after the canonical head: today's default), ``neighbours`` (after its n most similar
passages of the whole dataset file by MiniLM cosine; never the question) and ``previous``
(after the passage before it in its case), each with ``--neighbour-rows`` (``reused``: the
neighbours' stored or isolated KV; ``computed``: computed with the chunk). Writes
``OUT/NAME.json`` after every question and prints a markdown table (KL also relative to
isolated reuse's).

    OMP_NUM_THREADS=1 python benchmarks/quality/neighbour_contexts.py \\
        --dataset ../shared/data/musique_dev.json --offset 20 --limit 20 \\
        --out benchmarks/results/amd-avx512bf16
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from ragblend import BlendEngine
from ragblend.bench import study
from ragblend.bench.harness import Variant, run_benchmark
from ragblend.bench.neighbours import dataset_neighbours
from ragblend.store.memory import MemoryStore

STORE_BYTES = 1 << 30  # a question's chunks, several times over: the LRU drops old questions
METRICS = ("answer_kl_mean", "first_token_kl_mean", "agreement_with_full", "f1")


def contexts(engine: BlendEngine, args: argparse.Namespace) -> dict[str, dict]:
    """Config overrides, neighbour source and store of each precompute context under test
    (one store each: every context keys a chunk by its content alone)."""
    out: dict[str, dict] = {"canonical": {"precompute_context": "canonical", "store": None}}
    for kind in args.contexts.split(","):
        if kind == "canonical":
            continue
        source = dataset_neighbours(kind, args.dataset, engine.tokenizer, args.chunk_tokens)
        for rows in args.neighbour_rows.split(","):
            name = f"neighbours{args.neighbours}" if kind == "neighbours" else kind
            name += "" if rows == "reused" else f" {rows}"
            out[name] = {
                "precompute_context": kind,
                "neighbours": source,
                "neighbour_rows": rows,
                "store": MemoryStore(STORE_BYTES),
            }
            if kind == "neighbours":
                out[name]["precompute_neighbours"] = args.neighbours
    return out


KL_HEADER = (
    "| variant | answer KL | ans KL / isolated reuse | 1st-token KL | 1st KL / isolated reuse "
    "| agreement | recomputed |"
)


def kl_row(name: str, m: dict, base: dict) -> str:
    """A markdown row of variant ``name``'s metrics ``m``, KL also relative to ``base``'s."""
    a, f = m["answer_kl_mean"], m["first_token_kl_mean"]
    return (
        f"| {name} | {a:.4f} | {a / base['answer_kl_mean']:.2f}× | {f:.4f} "
        f"| {f / base['first_token_kl_mean']:.2f}× | {m['agreement_with_full']:.2f} "
        f"| {m['recomputed_fraction_mean']:.3f} |"
    )


def table(results: dict) -> str:
    """Markdown: one row per variant, KL also as a multiple of isolated reuse's."""
    modes = results["modes"]
    base = modes["reuse canonical"]
    lines = [KL_HEADER, "|---|---:|---:|---:|---:|---:|---:|"]
    lines += [kl_row(name, m, base) for name, m in modes.items()]
    lines += ["", "| precompute context | warmup chunks/s | vs canonical |", "|---|---:|---:|"]
    warm = results["warmup_chunks_per_s"]
    for name, rate in warm.items():
        lines.append(f"| {name} | {rate:.3f} | {rate / warm['canonical']:.2f}× |")
    return "\n".join(lines) + "\n"


def summarize(per_question: list[dict], warm: dict[str, list[float]], chunks: int) -> dict:
    modes = {}
    for name in per_question[0]:
        rows = [q[name] for q in per_question]
        modes[name] = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
        modes[name]["n"] = len(rows)
    rates = {name: chunks / sum(ts) for name, ts in warm.items()}
    return {"modes": modes, "warmup_chunks_per_s": rates, "per_question": per_question}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    study.add_case_arguments(ap, offset=20, limit=20)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--neighbours", type=int, default=2, help="n of the neighbours context")
    ap.add_argument("--contexts", default="canonical,neighbours,previous")
    ap.add_argument(
        "--neighbour-rows",
        default="reused",
        help="comma list of neighbour_rows values to run each neighbour context with",
    )
    study.add_model_arguments(ap, dtype="float32")
    study.add_output_arguments(ap, name="neighbour_contexts_smollm2_fp32")
    args = ap.parse_args()

    engine = BlendEngine.from_pretrained(args.model, dtype=args.dtype)
    cases = study.cases(args, engine.tokenizer)
    ctx = contexts(engine, args)
    ctx["canonical"]["store"] = MemoryStore(STORE_BYTES)
    views = {name: engine.with_config(**o) for name, o in ctx.items()}
    variants = [Variant("full", "full")]
    for mode in ("reuse", "blend"):
        for name, o in ctx.items():
            extra = {"ratio": args.ratio} if mode == "blend" else {}
            variants.append(Variant(f"{mode} {name}", mode, {**o, **extra}))
    warm: dict[str, list[float]] = {name: [] for name in ctx}
    per_question: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        for name, view in views.items():  # timed warmup; the harness then finds them stored
            start = time.perf_counter()
            view.precompute(case.chunks)
            warm[name].append(time.perf_counter() - start)
        res = run_benchmark(engine, [case], variants, 1, args.max_new_tokens, progress=False)
        per_question.append(
            {
                name: {k: m[k] for k in (*METRICS, "recomputed_fraction_mean")}
                for name, m in res["modes"].items()
            }
        )
        results = summarize(per_question, warm, len(per_question) * args.top_k)
        settings = {k: v for k, v in vars(args).items()}
        results["settings"] = {
            **settings,
            "n": len(per_question),
            "torch_threads": torch.get_num_threads(),
            "cached_temperature": engine.config.selection.cached_temperature,
            "check_layers": list(engine.config.check_layers),
        }
        study.write_outputs(out, args.name, results)
        study.question_done(i, len(cases), t0)
    print(table(results))


if __name__ == "__main__":
    main()
