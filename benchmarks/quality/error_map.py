"""Where does reuse's error live on neighbour-aware caches? (issue 54)

For each question the chunks are precomputed after their neighbours (the engine's default
``precompute_context``; ``--precompute-context`` to compare), then:

1. **KV deviation map.** A real full prefill and a reuse prefill of the same prompt give every
   cached row's K/V error on every layer: ``(|ΔK|² / mean|K|² + |ΔV|² / mean|V|²) / 2`` with the
   means over the layer's chunk rows of the full prefill. It is grouped by layer, by the row's
   place in its chunk (start = first 16 rows, then thirds), by the chunk's place in the prompt
   and by whether the chunk's prompt predecessor was one of its precompute neighbours.
2. **What recomputing a group buys.** Blend recomputes exactly one group of rows from check
   layer 1 on (a fixed selection, no temperature), and its first-token and teacher-forced
   answer KL to full prefill are compared with reuse's: the KL a group removes, per 1 % of the
   cached rows it costs. ``oracle`` is the rows with the largest true deviation summed over
   layers, at the default ratio: what a perfect layer-agnostic selector reaches at that cost.
   Every layer-1 K/V is recomputed in every run (that is what a check at layer 1 needs), so
   ``layer-1 only`` (an empty group) is the floor the groups start from.

``--exact-first-chunk`` serves the prompt's first chunk from its exact entry (today's default,
``BlendConfig.exact_first_chunk``): its rows are then exact, never recomputed and left out of
every group, the budget base and the maps; without it (the first map) every chunk is served
from its neighbour cache.

Writes ``OUT/NAME.{json,md,png}`` (``--name``, default ``error_map``; after every question; the
plot at the end).

    python benchmarks/quality/error_map.py --dataset ../shared/data/musique_dev.json \\
        --offset 0 --limit 12 --out benchmarks/results/amd-avx2
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from ragblend import BlendEngine
from ragblend.bench import study
from ragblend.bench.metrics import add_decode_activations_argument, kl_divergence

START_ROWS = 16
PLACES = ("start", "first third", "middle third", "last third")


class FixedRows:
    """Selector scoring the rows of one group 1 and every other row 0."""

    name = "fixed"

    def __init__(self, rows: torch.Tensor) -> None:
        self.values = rows.float()

    def scores(self, check) -> torch.Tensor:
        return self.values[check.rows]


def row_layout(prompt, neighbours_of, exact_first: bool = False) -> dict[str, torch.Tensor]:
    """Per prompt row: chunk index (-1 off chunks), offset in the chunk, place bin (-1 off
    chunks) and whether the chunk's predecessor in the prompt is one of its neighbours.
    ``exact_first``: the first chunk's rows are exact, so off chunks too."""
    n = len(prompt.ids)
    chunk = torch.full((n,), -1)
    offset = torch.zeros(n, dtype=torch.long)
    place = torch.full((n,), -1)
    pred = torch.zeros(n, dtype=torch.bool)
    start = len(prompt.head)
    for i, ids in enumerate(prompt.chunks):
        start += len(prompt.separator) if i else 0
        span = slice(start, start + len(ids))
        if i == 0 and exact_first:
            start += len(ids)
            continue
        chunk[span] = i
        offsets = torch.arange(len(ids))
        offset[span] = offsets
        third = (offsets - START_ROWS).clamp_min(0) * 3 // max(1, len(ids) - START_ROWS)
        place[span] = torch.where(offsets < START_ROWS, 0, 1 + third.clamp_max(2))
        if i and prompt.chunk_texts[i - 1] in neighbours_of(prompt.chunk_texts[i]):
            pred[span] = True
        start += len(ids)
    return {"chunk": chunk, "offset": offset, "place": place, "pred_neighbour": pred}


def kv_deviation(full, reuse, rows: torch.Tensor) -> torch.Tensor:
    """[layers, N] relative K/V error of ``reuse`` against ``full``, normalised on ``rows``."""
    out = []
    for f, r in zip(full.cache.layers, reuse.cache.layers):
        parts = []
        for a, b in ((f.keys, r.keys), (f.values, r.values)):
            err = (a.float() - b.float()).pow(2).sum((0, 1, 3))
            scale = a.float().pow(2).sum((0, 1, 3))[rows].mean().clamp_min(1e-12)
            parts.append(err / scale)
        out.append((parts[0] + parts[1]) / 2)
    return torch.stack(out)


def row_groups(layout: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Chunk rows by chunk, by place in the chunk and by predecessor (bool [N] each, by
    category then label; empty groups left out)."""
    chunk, place, pred = layout["chunk"], layout["place"], layout["pred_neighbour"]
    on = chunk >= 0
    masks = {
        "chunk": {f"chunk {i}": chunk == i for i in range(int(chunk.max()) + 1)},
        "place": {name: place == p for p, name in enumerate(PLACES)},
        "predecessor": {
            "predecessor is a neighbour": on & pred & (chunk > 0),
            "predecessor is not": on & ~pred & (chunk > 0),
        },
    }
    return {key: {k: m for k, m in group.items() if m.any()} for key, group in masks.items()}


def recompute_groups(
    layout: dict[str, torch.Tensor], dev: torch.Tensor, ratio: float
) -> dict[str, torch.Tensor]:
    """The row groups whose recompute is measured (bool [N] each)."""
    on = layout["chunk"] >= 0
    out = {"layer-1 only": torch.zeros_like(on)}
    for group in row_groups(layout).values():
        out.update(group)
    last = int(on.nonzero().max())
    out["last 128 rows"] = on & (torch.arange(on.numel()) > last - 128)
    total = dev.sum(0).masked_fill(~on, -1)
    oracle = torch.zeros_like(on)
    oracle[total.topk(round(ratio * int(on.sum()))).indices] = True
    out[f"oracle r={ratio}"] = oracle
    return out


def measure(engine: BlendEngine, case, max_new_tokens: int, ratio: float) -> dict:
    """One question: the deviation by group and what each group's recompute buys."""
    engine.precompute(case.chunks)
    prompt = engine.tokenize(case.question, case.chunks)
    segments, _ = engine.chunks.lookup(prompt)
    exact_first = any(s.kind == "chunk" and s.exact for s in segments)
    full = engine.prefill(prompt, "full")
    answer = engine.greedy_answer(full, max_new_tokens)
    ref = engine.teacher_forced_logits(full, answer)
    n_neigh = engine.config.precompute_neighbours
    source = engine.neighbours

    def neighbours_of(text: str) -> list[str]:
        return source.neighbours(text, n_neigh, engine.config.namespace) if source else []

    layout = row_layout(prompt, neighbours_of, exact_first)
    on = layout["chunk"] >= 0
    record: dict = {"chunk_rows": int(on.sum())}

    def kls(pre) -> dict[str, float]:
        tf = engine.teacher_forced_logits(pre, answer)
        return {
            "first_token_kl": float(kl_divergence(full.logits, pre.logits)),
            "answer_kl": float(kl_divergence(ref, tf).mean()),
        }

    reuse = engine.prefill(prompt, "reuse")
    dev = kv_deviation(full, reuse, on)
    record["reuse"] = kls(reuse)
    record["blend (defaults)"] = kls(engine.prefill(prompt, "blend"))
    record["deviation_by_layer"] = dev[:, on].mean(1).tolist()
    record["deviation_by"] = {
        key: {label: dev[:, rows].mean(1).tolist() for label, rows in group.items()}
        for key, group in row_groups(layout).items()
    }
    record["groups"] = {}
    for name, rows in recompute_groups(layout, dev, ratio).items():
        size = int(rows.sum())
        view = engine.with_config(  # exactly this group: every selection option off
            selector=FixedRows(rows),
            ratio=size / int(on.sum()),
            check_layers=(1,),
            check_scales=None,
            selection=dataclasses.replace(engine.config.selection, cached_temperature=1.0),
            chunk_start_tokens=0,
            near_question_tokens=0,
        )
        record["groups"][name] = {"rows": size, **kls(view.prefill(prompt, "blend"))}
    return record


def summarize(records: list[dict]) -> dict:
    """Means over questions; per group the KL left relative to reuse and its cost."""
    mean = statistics.fmean
    out: dict = {"n": len(records)}
    for mode in ("reuse", "blend (defaults)"):
        out[mode] = {k: mean(r[mode][k] for r in records) for k in records[0][mode]}
    layers = len(records[0]["deviation_by_layer"])
    out["deviation_by_layer"] = [
        mean(r["deviation_by_layer"][i] for r in records) for i in range(layers)
    ]
    out["deviation_by"] = {}
    for key in ("chunk", "place", "predecessor"):
        labels = dict.fromkeys(lab for r in records for lab in r["deviation_by"].get(key, {}))
        out["deviation_by"][key] = {
            lab: [
                mean(vals)
                for vals in zip(
                    *(r["deviation_by"][key][lab] for r in records if lab in r["deviation_by"][key])
                )
            ]
            for lab in labels
        }
    table = {}
    names = dict.fromkeys(g for r in records for g in r["groups"])
    for g in names:
        rs = [r for r in records if g in r["groups"]]
        share = mean(r["groups"][g]["rows"] / r["chunk_rows"] for r in rs)
        row = {"questions": len(rs), "share_of_rows": share}
        for k in ("first_token_kl", "answer_kl"):
            base = mean(r["reuse"][k] for r in rs)
            val = mean(r["groups"][g][k] for r in rs)
            row[k] = val
            row[f"{k}_vs_reuse"] = val / base if base else float("nan")
            row[f"{k}_removed_per_pct_rows"] = (
                (base - val) / base / (100 * share) if base and share else 0.0
            )
        table[g] = row
    out["groups"] = table
    return out


def markdown(summary: dict) -> str:
    """The group table and the deviation by place, chunk and predecessor."""
    lines = [
        f"n = {summary['n']} questions; reuse: first-token KL "
        f"{summary['reuse']['first_token_kl']:.4f}, answer KL "
        f"{summary['reuse']['answer_kl']:.4f}; blend (defaults): "
        f"{summary['blend (defaults)']['first_token_kl']:.4f}, "
        f"{summary['blend (defaults)']['answer_kl']:.4f}",
        "",
        "| recomputed group | rows | 1st KL / reuse | removed per 1 % rows "
        "| answer KL / reuse | removed per 1 % rows |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, g in summary["groups"].items():
        lines.append(
            f"| {name} | {100 * g['share_of_rows']:.1f} % | {g['first_token_kl_vs_reuse']:.2f} "
            f"| {100 * g['first_token_kl_removed_per_pct_rows']:.2f} % "
            f"| {g['answer_kl_vs_reuse']:.2f} "
            f"| {100 * g['answer_kl_removed_per_pct_rows']:.2f} % |"
        )
    lines += ["", "| rows | mean KV deviation, layers 0–end | layers ≥ 10 |", "|---|---:|---:|"]
    for key, curves in summary["deviation_by"].items():
        for label, curve in curves.items():
            late = curve[10:] or curve
            lines.append(
                f"| {key}: {label} | {statistics.fmean(curve):.3f} | {statistics.fmean(late):.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    for key, style in (("place", "-"), ("predecessor", "--")):
        for label, curve in summary["deviation_by"][key].items():
            ax.plot(curve, style, label=label)
    ax.plot(summary["deviation_by_layer"], "k", lw=2, label="all chunk rows")
    ax.set(xlabel="layer", ylabel="relative K/V deviation, reuse vs full", yscale="log")
    ax.legend(fontsize=7)
    ax = axes[1]
    for label, curve in summary["deviation_by"]["chunk"].items():
        ax.plot(curve, label=label)
    ax.set(xlabel="layer", ylabel="relative K/V deviation", yscale="log", title="by chunk place")
    ax.legend(fontsize=7)
    ax = axes[2]
    names = list(summary["groups"])
    y = range(len(names))
    first = [summary["groups"][n]["first_token_kl_vs_reuse"] for n in names]
    answer = [summary["groups"][n]["answer_kl_vs_reuse"] for n in names]
    ax.barh([i + 0.2 for i in y], first, 0.4, label="first-token KL / reuse")
    ax.barh([i - 0.2 for i in y], answer, 0.4, label="answer KL / reuse")
    shares = [100 * summary["groups"][n]["share_of_rows"] for n in names]
    ax.set_yticks(list(y), [f"{n} ({s:.0f}%)" for n, s in zip(names, shares)])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set(xlabel="KL left after recomputing the group (reuse = 1)")
    ax.legend(fontsize=7)
    fig.suptitle(f"reuse's error on neighbour-aware caches ({summary['n']} questions)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    study.add_case_arguments(ap, offset=0, limit=12, max_new_tokens=24)
    ap.add_argument("--precompute-context", default=None, help="default: the engine's")
    ap.add_argument(
        "--exact-first-chunk",
        action="store_true",
        help="serve the first chunk from its exact entry (the engine's default; off: every "
        "chunk from its neighbour cache, as the first map)",
    )
    study.add_model_arguments(ap, dtype="auto")
    add_decode_activations_argument(ap)
    study.add_output_arguments(ap, name="error_map")
    args = ap.parse_args()

    overrides = {"precompute_context": args.precompute_context} if args.precompute_context else {}
    # without --exact-first-chunk, the neighbour caches' own error: every chunk from its cache
    overrides["exact_first_chunk"] = args.exact_first_chunk
    overrides["decode_activations"] = args.decode_activations
    engine = study.engine(args, args.model, dtype=args.dtype, **overrides)
    cases = study.cases(args, engine.tokenizer)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        records.append(measure(engine, case, args.max_new_tokens, engine.config.ratio))
        summary = summarize(records)
        summary["settings"] = {**vars(args), "config": repr(engine.config)}
        results = {"summary": summary, "per_question": records}
        study.write_outputs(out, args.name, results, markdown(summary))
        study.question_done(i, len(cases), t0)
    plot(summary, out / f"{args.name}.png")
    print(markdown(summary))


if __name__ == "__main__":
    main()
