"""Can the rows blend does not recompute be repaired cheaply? (issue 54)

Neighbour-aware caches with the first chunk's exact entry (the defaults); per question against a
real full prefill: first-token KL, teacher-forced answer KL, greedy agreement.

1. **Where the first token's error enters** (an oracle). Every approximate row enters the fused
   prefill at layer E with its hidden state from full prefill, so layers ≥ E hold exact K/V and
   only the cached K/V of the layers before E still differ: the KL left is what the first E
   layers' cached rows cost.
2. **Late entry** (a lever). The same, from each row's hidden state in its precompute context,
   what a store could keep beside the K/V (one [D] vector per row and entry layer), alone and
   on top of blend at r = 0.15: the deep layers then recompute every row, from a hidden state
   that carries the neighbour context's error.
3. **A chunk-wide shift** (an oracle). Each approximate chunk's cached pre-RoPE K and/or V moved
   by the chunk's mean error (full − cached) on every layer, optionally leaving out the chunk's
   first 16 rows: the best any estimate of a shift shared by a chunk's rows could do.

The entry needs the fusor's own layer loop with one step added (the active rows become every
candidate row at layer E, their hidden states given): this script builds that loop from
:func:`ragblend.fusion.fusor.fuse`'s source and fails if the step no longer fits in. The shift
wraps the layer loader. ``recomputed`` is the mean share of the approximate rows run through
each layer (the cost the recompute adds; late entry's stored states are not a real store here).

Writes ``OUT/NAME.{json,md,png}`` (after every question; the plot at the end).

    python benchmarks/unselected_repair.py --dataset ../shared/data/musique_dev.json \\
        --offset 0 --limit 12 --name tune_unselected_repair --out benchmarks/results/intel-amx
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch

import ragblend.engine as engine_module
import ragblend.fusion.fusor as fusor_module
from ragblend import BlendEngine
from ragblend.bench.datasets import load_cases
from ragblend.bench.metrics import add_decode_activations_argument, kl_divergence
from ragblend.bench.neighbours import with_dataset_neighbours

ORACLE_LAYERS = (5, 10, 15, 20, 25)
LATE_LAYERS = (15, 20, 26)
START_ROWS = 16

# what the patched loop and the loader read for the prefill being run
ENTRY: dict = {}  # {"layer": E, "hidden": [1, C, D] in candidate order}
SHIFT: dict = {}  # {"k": [per layer [1, H, N, d]] or None, "v": ..., "chunks": [rows], "skip"}

_ENTRY_STEP = """
if ENTRY and layer == ENTRY["layer"]:
    hidden_all = ENTRY["hidden"].clone()
    hidden_all[:, torch.searchsorted(rows.candidates, active)] = hidden
    hidden, active, active_list = hidden_all, rows.candidates, rows.candidate_list
    plans.clear()
"""


def entering_fuse() -> Callable:
    """:func:`fuse` with the entry step at the top of its layer loop."""
    source = inspect.getsource(fusor_module.fuse)
    loop = "    for layer, k_cached, v_cached in layers:\n"
    decorator = "@torch.inference_mode()\n"
    if loop not in source or decorator not in source:
        raise SystemExit("fuse's layer loop changed: update the entry step of this benchmark")
    source = source.replace(loop, loop + textwrap.indent(_ENTRY_STEP, " " * 8), 1)
    namespace = {**vars(fusor_module), "ENTRY": ENTRY}
    exec(source.replace(decorator, "", 1), namespace)
    return torch.inference_mode()(namespace["fuse"])


def shifted(layers) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The loader's layers with each approximate chunk's K/V moved by its mean error."""
    for layer, k, v in layers:
        for part, cached in (("k", k), ("v", v)):
            full = SHIFT.get(part)
            if full is None:
                continue
            for rows in SHIFT["chunks"]:
                rows = rows[SHIFT["skip"] :]
                cached[:, :, rows] += (full[layer][:, :, rows] - cached[:, :, rows]).mean(
                    2, keepdim=True
                )
        yield layer, k, v


class HiddenCapture:
    """Records each layer's output hidden states [1, T, D] while ``on`` (wraps ``finish``)."""

    def __init__(self, layers) -> None:
        self.on, self.out = False, {}
        original = layers.finish

        def finish(layer, hidden, *args, **kwargs):
            result = original(layer, hidden, *args, **kwargs)
            if self.on:
                self.out[layer] = result.detach().clone()
            return result

        layers.finish = finish

    def run(self, fn: Callable) -> dict[int, torch.Tensor]:
        self.on, self.out = True, {}
        try:
            fn()
        finally:
            self.on = False
        return self.out


def prompt_layout(segments) -> tuple[list[int], list[tuple[int, object]]]:
    """Candidate rows (not in an exact cache), ascending, and (start, segment) of each
    approximate chunk."""
    candidates, chunks, pos = [], [], 0
    for seg in segments:
        if not (seg.kv is not None and seg.exact):
            candidates += range(pos, pos + len(seg))
        if seg.kind == "chunk" and seg.kv is not None and not seg.exact:
            chunks.append((pos, seg))
        pos += len(seg)
    return candidates, chunks


def neighbour_hidden(engine, capture, prompt, candidates, chunks, entries) -> dict:
    """{E: [1, C, D]}: each approximate chunk row's hidden state entering layer E in its
    precompute context (zeros on rows that are always computed)."""
    cache = engine.chunks
    context = cache.context_ids(prompt.head)
    index = {row: i for i, row in enumerate(candidates)}
    width = engine.model.config.hidden_size
    dtype = engine.layers.dtype
    out = {e: torch.zeros(1, len(candidates), width, dtype=dtype) for e in entries}
    texts = {tuple(ids): text for ids, text in zip(prompt.chunks, prompt.chunk_texts)}
    for start, seg in chunks:
        neighbours = cache.neighbour_ids(texts[tuple(seg.ids)])
        states = capture.run(
            lambda s=seg, nb=neighbours: cache.compute_kv(s.ids, context, neighbours=nb)
        )
        at = torch.tensor([index[r] for r in range(start, start + len(seg))])
        for e in entries:
            out[e][:, at] = states[e - 1][:, -len(seg) :]
    return out


def full_pre_rope(engine, full, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Full prefill's K (RoPE undone) and V per layer, [1, H, N, d] each."""
    lay, like = engine.layers, torch.zeros(1)
    keys, values = [], []
    for layer, cached in enumerate(full.cache.layers):
        cos, sin = lay.rope(torch.arange(n), like, layer)
        keys.append(lay.rotate(cached.keys.float(), cos, -sin))
        values.append(cached.values.float())
    return keys, values


class Repair(NamedTuple):
    """One prefill of the grid: its mode and ratio, the entry and the shift it runs with."""

    name: str
    mode: str
    ratio: float | None = None
    entry: dict = {}
    shift: dict = {}


def measure(engine, capture, case, max_new_tokens: int) -> dict[str, dict]:
    """One question: every variant's KLs, agreement and recomputed share."""
    engine.precompute(case.chunks)
    prompt = engine.tokenize(case.question, case.chunks)
    segments, _ = engine.chunks.lookup(prompt)
    candidates, chunks = prompt_layout(segments)
    n = sum(len(s) for s in segments)
    stored = neighbour_hidden(engine, capture, prompt, candidates, chunks, LATE_LAYERS)
    states = capture.run(lambda: engine.prefill(prompt, "blend", ratio=1.0))  # == full
    exact = {e: states[e - 1] for e in ORACLE_LAYERS}
    full = engine.prefill(prompt, "full")
    keys, values = full_pre_rope(engine, full, n)
    rows = [torch.arange(start, start + len(seg)) for start, seg in chunks]

    grid = [
        Repair("full", "full"),
        Repair("reuse", "reuse"),
        Repair("blend r=0.15 (defaults)", "blend", 0.15),
        Repair("blend r=0.3", "blend", 0.3),
    ]
    for e in ORACLE_LAYERS:
        entry = {"layer": e, "hidden": exact[e]}
        grid.append(Repair(f"oracle: exact hidden states from layer {e}", "reuse", entry=entry))
    for e in LATE_LAYERS:
        entry = {"layer": e, "hidden": stored[e]}
        grid.append(Repair(f"late entry at layer {e}", "reuse", entry=entry))
        grid.append(Repair(f"blend r=0.15 + late entry at layer {e}", "blend", 0.15, entry))
    for label, k, skip in (
        ("K and V", keys, 0),
        ("V", None, 0),
        (f"V, first {START_ROWS} rows left out", None, START_ROWS),
    ):
        shift = {"k": k, "v": values, "chunks": rows, "skip": skip}
        grid.append(Repair(f"oracle: chunk-mean shift of {label}", "reuse", shift=shift))

    records, reference = {}, None
    for name, mode, ratio, entry, shift in grid:
        ENTRY.update(entry)
        SHIFT.update(shift)
        try:
            pre = engine.prefill(prompt, mode, ratio=ratio)
        finally:
            ENTRY.clear()
            SHIFT.clear()
        if reference is None:
            ids = engine.greedy_answer(pre, max_new_tokens)
            ended = len(ids) < max_new_tokens
            taught = ids + [min(engine.eos_ids)] if ended else ids
            reference = (pre.logits, ids, ended, engine.teacher_forced_logits(pre, taught))
        ref_logits, ids, ended, ref_tf = reference
        taught = ids + [min(engine.eos_ids)] if ended else ids
        tf = engine.teacher_forced_logits(pre, taught)
        m = len(ids)
        agrees = bool((tf[:m].argmax(-1) == torch.tensor(ids)).all())
        if ended:
            agrees = agrees and int(tf[m].argmax()) in engine.eos_ids
        records[name] = {
            "first_token_kl": float(kl_divergence(ref_logits, pre.logits)),
            "answer_kl": float(kl_divergence(ref_tf[:m], tf[:m]).mean()) if m else 0.0,
            "agrees": agrees,
            "recomputed_fraction": pre.stats.recomputed_fraction,
        }
    return records


def summarize(rows: list[dict[str, dict]]) -> dict:
    """Per-variant means and the ratio of the mean KLs to reuse's."""
    mean = statistics.fmean
    out = {}
    for name in rows[0]:
        recs = [r[name] for r in rows]
        out[name] = {
            "answer_kl_mean": mean(r["answer_kl"] for r in recs),
            "first_token_kl_mean": mean(r["first_token_kl"] for r in recs),
            "agreement_with_full": mean(float(r["agrees"]) for r in recs),
            "recomputed_fraction_mean": mean(r["recomputed_fraction"] for r in recs),
        }
    base = out["reuse"]
    for rec in out.values():
        for k in ("answer_kl", "first_token_kl"):
            rec[f"{k}_vs_reuse"] = rec[f"{k}_mean"] / base[f"{k}_mean"]
    return {"n": len(rows), "modes": out}


def table(summary: dict) -> str:
    lines = [
        f"n = {summary['n']} questions",
        "",
        "| variant | recomputed | answer KL | / reuse | first-token KL | / reuse | agreement |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in summary["modes"].items():
        lines.append(
            f"| {name} | {m['recomputed_fraction_mean']:.3f} | {m['answer_kl_mean']:.4f} "
            f"| {m['answer_kl_vs_reuse']:.2f} | {m['first_token_kl_mean']:.4f} "
            f"| {m['first_token_kl_vs_reuse']:.2f} | {m['agreement_with_full']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in summary["modes"] if n != "full"]
    modes = summary["modes"]
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(names) + 1.5))
    y = range(len(names))
    ax.barh(
        [i + 0.2 for i in y],
        [modes[n]["first_token_kl_vs_reuse"] for n in names],
        0.4,
        label="first-token KL / reuse",
    )
    ax.barh(
        [i - 0.2 for i in y],
        [modes[n]["answer_kl_vs_reuse"] for n in names],
        0.4,
        label="answer KL / reuse",
    )
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set(
        xscale="log",
        xlabel="KL relative to reuse of the same caches (log)",
        title=f"repairing the rows blend does not recompute ({summary['n']} questions)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--offset", type=int, default=0)
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--skip-passages", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    add_decode_activations_argument(ap)
    ap.add_argument("--name", default="unselected_repair")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    engine_module.fuse = entering_fuse()
    engine = BlendEngine.from_pretrained(
        "embedded", dtype=args.dtype, decode_activations=args.decode_activations
    )
    engine = with_dataset_neighbours(engine, args.dataset, 512, explicit=True)
    capture = HiddenCapture(engine.layers)
    load = engine.chunks.loader
    engine.chunks.loader = lambda segments: shifted(load(segments)) if SHIFT else load(segments)
    cases = load_cases(
        args.dataset, engine.tokenizer, 6, 512, args.offset + args.limit, skip=args.skip_passages
    )[args.offset :]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        rows.append(measure(engine, capture, case, args.max_new_tokens))
        summary = summarize(rows)
        summary["settings"] = {**vars(args), "torch_threads": torch.get_num_threads()}
        (out / f"{args.name}.json").write_text(
            json.dumps({**summary, "per_question": rows}, indent=2)
        )
        (out / f"{args.name}.md").write_text(table(summary))
        print(f"question {i + 1}/{len(cases)} in {time.perf_counter() - t0:.0f}s", flush=True)
    plot(summary, out / f"{args.name}.png")
    print(table(summary))


if __name__ == "__main__":
    main()
