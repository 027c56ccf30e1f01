"""The fidelity–bytes frontier of chunk KV storage (issue 70): bytes per chunk token against
first-token KL, answer KL and agreement with full prefill, for reuse and blend at the default
ratio, per storage codec, with and without the first chunk's exact entry.

Every codec's entries live in one disk-tier store (warm page cache) and every variant runs on
the same held-out questions, interleaved per question, scored against full prefill exactly as
``quality_sweep.py`` scores (``ragblend.bench.fidelity``: teacher-forced answer KL, first-token
KL, exact greedy agreement; exact decode activations). ``bytes/token`` is measured from the
stored entries: the chunk's neighbour-context entry alone, and with its exact first-chunk entry
(both per chunk token, as a corpus stores them). Speedup is the median per-question TTFT ratio
to full prefill in this run.

Each chunk's KV is computed once (float, by the first codec's precompute) and packed into every
codec from that: a codec's neighbour-context precompute reads its neighbours' KV before
compression, which a store of that codec alone would read after it — a second-order difference
that favours no codec over another.

    python benchmarks/kv_frontier.py --dataset ../shared/data/musique_dev.json --offset 12 \\
        --limit 28 --out benchmarks/results/amd-avx2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from ragblend import BlendEngine
from ragblend.bench import study
from ragblend.bench.fidelity import measure_case, summarize
from ragblend.bench.harness import Variant
from ragblend.bench.metrics import add_decode_activations_argument
from ragblend.config import fold_selection
from ragblend.store import DiskStore

DEFAULT_CODECS = "float32,bfloat16,int8,int4,pca4,pca2,pca1,int2"


def variants(codecs: list[str]) -> list[Variant]:
    """full, then per codec reuse and blend (default ratio), with and without the first
    chunk's exact entry."""
    out = [Variant("full", "full")]
    for codec in codecs:
        for first in (True, False):
            tag = " +first" if first else ""
            for mode in ("reuse", "blend"):
                overrides = {"kv_dtype": codec, "exact_first_chunk": first}
                out.append(Variant(f"{mode} {codec}{tag}", mode, overrides))
    return out


def memoised(engines: list[BlendEngine]) -> None:
    """Every engine's chunk KV computed once: the first to compute a chunk in a context
    shares the float result with the others (see the module docstring)."""
    memo: dict = {}
    for engine in engines:
        compute = engine.chunks.compute_kv

        def shared(ids, context_ids, between_layers=None, neighbours=(), prefix=None, _c=compute):
            key = (tuple(ids), tuple(context_ids), tuple(tuple(n) for n in neighbours))
            if key not in memo:
                memo[key] = _c(ids, context_ids, between_layers, neighbours, prefix)
            return memo[key]

        engine.chunks.compute_kv = shared  # type: ignore[method-assign]


def stored_bytes(engine: BlendEngine, chunks: list[list[int]], head: list[int]) -> dict:
    """Bytes and tokens of each chunk's stored entries: neighbour-context, exact first."""
    stored = engine.chunks.stored_entries(chunks, head)
    if len(stored) != len(chunks) or any(len(entries) != 2 for entries in stored):
        raise SystemExit(f"kv_frontier: a {engine.kv_dtype} entry is missing after warmup")
    return {
        "tokens": sum(map(len, chunks)),
        "entry_bytes": sum(own.nbytes for own, _ in stored),
        "first_bytes": sum(first.nbytes for _, first in stored),
    }


def table(results: dict) -> str:
    modes, speedup, sizes = results["modes"], results["speedup_vs_full"], results["bytes"]
    lines = [
        "| codec | first chunk | B/token stored | × bf16 ×2 | mode | speedup | recomputed "
        "| 1st-token KL | answer KL | agreement |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, m in modes.items():
        if name == "full":
            continue
        mode, codec, *rest = name.split(" ")
        first = bool(rest)
        per_token = sizes[codec]["with_first" if first else "entry"]
        base = sizes["baseline_bytes_per_token"]
        lines.append(
            f"| {codec} | {'exact entry' if first else 'none'} | {per_token:,.0f} "
            f"| {per_token / base:.3f} | {mode} | {speedup[name]:.2f}× "
            f"| {m['recomputed_fraction_mean']:.3f} | {m['first_token_kl_mean']:.4f} "
            f"| {m['answer_kl_mean']:.4f} | {m['agreement_with_full']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes, sizes = results["modes"], results["bytes"]
    keys = (
        ("first_token_kl_mean", "first-token KL"),
        ("answer_kl_mean", "answer KL"),
        ("agreement_with_full", "agreement"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    for ax, (key, label) in zip(axes, keys):
        for mode, marker in (("blend", "o"), ("reuse", "^")):
            for first, fill in ((True, "full"), (False, "none")):
                pts = []
                for name, m in modes.items():
                    parts = name.split(" ")
                    if parts[0] != mode or (len(parts) == 3) != first:
                        continue
                    size = sizes[parts[1]]["with_first" if first else "entry"]
                    pts.append((size, m[key], parts[1]))
                pts.sort()
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker=marker,
                    fillstyle=fill,
                    label=f"{mode}{' + exact first chunk' if first else ''}",
                )
                for x, y, codec in pts:
                    ax.annotate(
                        codec, (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points"
                    )
        base = modes.get("blend bfloat16 +first")
        if base is not None:  # today's defaults forced, and the targets around them
            ax.axvline(sizes["baseline_bytes_per_token"] / 8, color="grey", ls=":", lw=0.8)
            limit = base[key] * (1.1 if key != "agreement_with_full" else 1.0)
            ax.axhline(limit, color="grey", ls=":", lw=0.8, label="1/8 of today's bytes; 1.1× KL")
        ax.set(xscale="log", xlabel="stored bytes per chunk token (log)", ylabel=label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"chunk KV: fidelity to full prefill vs bytes ({results['settings']['model']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    study.add_case_arguments(ap, offset=12, limit=28)
    ap.add_argument("--codecs", default=DEFAULT_CODECS, help="kv_dtypes, comma-separated")
    study.add_model_arguments(ap, dtype="float32")
    add_decode_activations_argument(ap)
    study.add_output_arguments(ap, name="kv_frontier")
    args = ap.parse_args()
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]

    store = DiskStore(tempfile.mkdtemp(prefix="ragblend-frontier-"), 1 << 40, fsync=False)
    engine = study.engine(
        args, args.model, dtype=args.dtype, decode_activations=args.decode_activations, store=store
    )
    cases = study.cases(args, engine.tokenizer)
    grid = variants(codecs)
    views = {v.name: engine.with_config(**fold_selection(engine.config, v.overrides)) for v in grid}
    writers = {c: engine.with_config(kv_dtype=c, exact_first_chunk=True) for c in codecs}
    memoised(list(writers.values()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    sizes = {c: {"tokens": 0, "entry_bytes": 0, "first_bytes": 0} for c in codecs}
    warmup_s = {c: 0.0 for c in codecs}
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        for codec, writer in writers.items():
            t = time.perf_counter()
            writer.precompute(case.chunks)
            warmup_s[codec] += time.perf_counter() - t
            prompt = writer.tokenize(case.question, case.chunks)
            for k, v in stored_bytes(writer, prompt.chunks, prompt.head).items():
                sizes[codec][k] += v
        rows.append(measure_case(engine, views, grid, case, args.max_new_tokens))
        results = summarize(rows)
        results["bytes"] = {
            c: {
                "entry": s["entry_bytes"] / s["tokens"],
                "with_first": (s["entry_bytes"] + s["first_bytes"]) / s["tokens"],
                "warmup_s_after_first": warmup_s[c],
            }
            for c, s in sizes.items()
        }
        lay = engine.layers
        results["bytes"]["baseline_bytes_per_token"] = (
            2 * 2 * 2 * (lay.num_layers * lay.num_kv_heads * lay.head_dim)
        )  # today's defaults on a bf16 CPU: two bfloat16 entries per chunk
        results["settings"] = {
            **vars(args),
            "codecs": codecs,
            "precompute_context": engine.config.precompute_context,
            "ratio": engine.config.ratio,
            "tier": "disk",
            "decode_activations_resolved": engine.decode_activations,
            "n": len(rows),
            "torch_threads": torch.get_num_threads(),
            "cpu_model": _cpu_model(),
        }
        study.write_outputs(out, args.name, results, table(results))
        study.question_done(i, len(cases), t0)
    plot(results, out / f"{args.name}.png")
    print(table(results))


def replot(path: Path) -> None:
    """Draw ``path`` (a results JSON of this script) again as its PNG."""
    plot(json.loads(path.read_text()), path.with_suffix(".png"))


def _cpu_model() -> str:
    from ragblend import cpu

    return str(cpu.describe().get("cpu_model", ""))


if __name__ == "__main__":
    main()
