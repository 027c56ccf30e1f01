"""The other quality levers on top of neighbour chunk caches (issue 34), on the bench harness.

Every variant runs on neighbour caches (n most similar passages before each chunk) except
``reuse canonical`` (isolated caches: the baseline every KL ratio is expressed against).
Levers, each against ``blend default`` (kv-deviation, r = 0.15, T = 1.06):

1. query-driven selectors (``relevance``, ``relevance-kv``, ``kv-attention``, ``attention``),
   at r = 0.15 and at the lower ``--equal-ratios`` that buy back their selection cost;
2. APE's cached-row temperature T and its context scale S: the attention mass of the rows
   still served from the cache multiplied by S (log S added to their logits after 1/T).
   S is benchmark-local (:class:`ScaledCachedKeys`, dense fp32 attention on tempered layers);
3. stale-row repair during decode, simulated (:func:`repair`): answer tokens from the k-th
   on are scored with the KV of a blend at a higher ratio (or of full prefill), the first k
   with the default blend's (per-token KL, teacher-forced on full prefill's greedy answer).

Timings are taken as they come (one measurement per variant and question, interleaved); on a
shared machine read only ratios. Writes ``OUT/NAME.json`` after every question.

    OMP_NUM_THREADS=1 python benchmarks/levers.py \\
        --dataset ../shared/data/musique_dev.json --offset 20 --limit 20 \\
        --out benchmarks/results/amd-avx512bf16
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch
from neighbour_contexts import KL_HEADER, kl_row  # benchmarks/, the script's own folder

import ragblend.fusion.fusor as fusor
from ragblend import BlendEngine
from ragblend.bench.datasets import Case, load_cases
from ragblend.bench.harness import Variant, run_benchmark
from ragblend.bench.metrics import kl_divergence
from ragblend.bench.neighbours import dataset_neighbours
from ragblend.fusion.attention import attend_rows
from ragblend.fusion.selection import CachedKeyTemperature, SelectionPolicy, cached_key_temper
from ragblend.fusion.selectors import KVDeviationSelector, register_selector
from ragblend.store.memory import MemoryStore

STORE_BYTES = 1 << 30
METRICS = ("answer_kl_mean", "first_token_kl_mean", "agreement_with_full", "f1")
TIMES = ("ttft_ms_median", "recomputed_fraction_mean", "decode_tokens_per_s")
SELECTORS = ("relevance", "relevance-kv", "kv-attention", "attention")
REPAIR_AFTER = (0, 1, 4, 8, 16)  # answer tokens decoded on the stale KV before the repair


class ScaledCachedKeys(CachedKeyTemperature):
    """APE on stale rows: logits divided by T, then log S added (attention mass × S)."""

    def __init__(self, temperature: float, scale: float, approximate: torch.Tensor) -> None:
        super().__init__(temperature, approximate)
        self.log_scale = math.log(scale)

    def attend(self, q, keys, values, plan, scaling, computed):
        """Dense fp32 masked attention of the plan's rows [1, H, m, d] → [1, m, H*d]."""
        rows = self.unscaled_rows(computed)
        if rows is None:
            return attend_rows(q, keys, values, plan, scaling)
        _, heads, m, dim = q.shape
        kv_heads, groups = keys.shape[1], heads // keys.shape[1]
        pos = plan.positions
        end = int(pos.max()) + 1
        stale = torch.ones(keys.shape[2], dtype=torch.bool, device=q.device)
        stale[rows] = False
        stale = stale[:end]
        factor = torch.where(stale, 1.0 / self.temperature, 1.0) * scaling
        bias = torch.where(stale, self.log_scale, 0.0)
        qf = q[0].float().reshape(kv_heads, groups * m, dim)
        logits = (qf @ keys[0, :, :end].float().transpose(1, 2)) * factor + bias
        future = torch.arange(end, device=q.device).view(1, -1) > pos.view(-1, 1)
        logits.view(kv_heads, groups, m, end).masked_fill_(future, float("-inf"))
        out = torch.softmax(logits, -1) @ values[0, :, :end].float()
        return out.view(heads, m, dim).transpose(0, 1).reshape(1, m, heads * dim).to(q.dtype)


def scaled_temper(selector, rows):
    """``cached_key_temper`` that honours a selector's ``context_scale`` (benchmark-local)."""
    wrapped = isinstance(selector, SelectionPolicy)  # not wrapped when T = 1
    scale = getattr(selector.inner if wrapped else selector, "context_scale", 1.0)
    if scale == 1.0:
        return cached_key_temper(selector, rows)
    temperature = selector.cached_temperature if wrapped else 1.0
    return ScaledCachedKeys(temperature, scale, rows.cached & ~rows.exact)


def scale_selector(scale: float) -> str:
    """Register kv-deviation carrying an APE context scale; returns its name."""
    name = f"kv-deviation-S{scale:g}"

    def factory(config):
        selector = KVDeviationSelector(config.deviation)
        selector.context_scale = scale
        return selector

    register_selector(name, factory)
    return name


def variants(args: argparse.Namespace, nb: dict, iso: dict) -> list[Variant]:
    """Baselines, then each lever's variants (all but ``reuse canonical`` on neighbour caches)."""
    r = args.ratio
    blend = {**nb, "ratio": r}
    out = [
        Variant("full", "full"),
        Variant("reuse canonical", "reuse", iso),
        Variant("reuse neighbours", "reuse", nb),
        Variant("blend default", "blend", blend),
    ]
    for sel in filter(None, args.selectors.split(",")):
        out.append(Variant(f"L1 {sel} r{r:g}", "blend", {**blend, "selector": sel}))
        for low in map(float, args.equal_ratios.split(",") if args.equal_ratios else []):
            out.append(
                Variant(f"L1 {sel} r{low:g}", "blend", {**nb, "ratio": low, "selector": sel})
            )
    for t in map(float, filter(None, args.temperatures.split(","))):
        out.append(Variant(f"L2 T{t:g}", "blend", {**blend, "cached_temperature": t}))
    for t in map(float, args.scale_temperatures.split(",")):
        for s in map(float, args.scales.split(",") if args.scales else []):
            extra = {"selector": scale_selector(s), "cached_temperature": t}
            out.append(Variant(f"L2 T{t:g} S{s:g}", "blend", {**blend, **extra}))
    return out


def repair(engine: BlendEngine, view: BlendEngine, case: Case, args) -> dict:
    """Simulated stale-row repair: answer KL when tokens from the k-th on see a better KV.

    Per-token KL (teacher-forced on full prefill's greedy answer) of the default blend and of
    blends at ``--repair-ratios``; repaired(k, r) = the default's KL on tokens < k, r's after
    (the first k tokens' own KV taken as r's too: an upper bound). Full prefill = KL 0.
    """
    prompt = view.tokenize(case.question, case.chunks)
    full = engine.prefill(prompt, "full")
    ids = engine.greedy_answer(full, args.max_new_tokens)
    ref = engine.teacher_forced_logits(full, ids)
    per_token, ttft = {}, {}
    for r in (args.ratio, *map(float, args.repair_ratios.split(","))):
        start = time.perf_counter()
        pre = view.prefill(prompt, "blend", r)
        ttft[f"{r:g}"] = (time.perf_counter() - start) * 1000
        per_token[f"{r:g}"] = kl_divergence(ref, engine.teacher_forced_logits(pre, ids)).tolist()
    per_token["full"] = [0.0] * len(ids)
    base = per_token[f"{args.ratio:g}"]
    kl = {
        f"after {k} -> {r}": statistics.fmean(base[:k] + tok[k:]) if tok else 0.0
        for r, tok in per_token.items()
        for k in REPAIR_AFTER
    }
    return {"answer_kl": kl, "ttft_ms": ttft, "tokens": len(ids)}


def summarize(per_question: list[dict], repairs: list[dict]) -> dict:
    """Means over questions; ``speedup_vs_full`` a median of per-question ratios."""
    modes = {}
    for name in per_question[0]:
        rows = [q[name] for q in per_question]
        modes[name] = {k: statistics.fmean(r[k] for r in rows) for k in rows[0] if k != "ttft"}
        modes[name]["speedup_vs_full"] = statistics.median(
            q["full"]["ttft"] / q[name]["ttft"] for q in per_question
        )
        modes[name]["n"] = len(rows)
    out = {"modes": modes, "per_question": per_question}
    if repairs:
        keys = repairs[0]["answer_kl"]
        out["repair_answer_kl"] = {
            k: statistics.fmean(r["answer_kl"][k] for r in repairs) for k in keys
        }
        out["repair_ttft_ms_median"] = {
            k: statistics.median(r["ttft_ms"][k] for r in repairs) for k in repairs[0]["ttft_ms"]
        }
        out["repairs"] = repairs
    return out


def table(results: dict) -> str:
    """Markdown: one row per variant, KL also as a multiple of isolated reuse's."""
    modes = results["modes"]
    base = modes["reuse canonical"]
    lines = [KL_HEADER + " TTFT / full |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in modes.items():
        lines.append(f"{kl_row(name, m, base)} {1 / m['speedup_vs_full']:.3f} |")
    for k, v in results.get("repair_answer_kl", {}).items():
        if k.endswith(f"-> {results['settings']['ratio']:g}"):
            continue  # the default blend itself
        lines.append(f"| L3 repair {k} | {v:.4f} | {v / base['answer_kl_mean']:.2f}× |||||")
    return "\n".join(lines) + "\n"


def equal_ttft(results: dict) -> str:
    """Markdown: each selector's KL interpolated (linearly in TTFT / full prefill, between its
    measured ratios) at the default blend's TTFT / full; "—" where that TTFT is outside them."""
    modes = results["modes"]
    base = modes["reuse canonical"]
    target = 1 / modes["blend default"]["speedup_vs_full"]
    lines = [
        f"Equal TTFT: at blend default's TTFT / full = {target:.3f}",
        "",
        "| selector | answer KL / iso reuse | 1st KL / iso reuse | ratio there |",
        "|---|---:|---:|---:|",
    ]
    for sel in filter(None, results["settings"]["selectors"].split(",")):
        pts = sorted(
            (1 / m["speedup_vs_full"], m, float(name.rsplit(" r", 1)[1]))
            for name, m in modes.items()
            if name.startswith(f"L1 {sel} r")
        )
        cells = ["—", "—", "—"]
        for (t0, m0, r0), (t1, m1, r1) in zip(pts, pts[1:]):
            if t0 <= target <= t1:
                w = (target - t0) / (t1 - t0) if t1 > t0 else 0.0
                a = (1 - w) * m0["answer_kl_mean"] + w * m1["answer_kl_mean"]
                f = (1 - w) * m0["first_token_kl_mean"] + w * m1["first_token_kl_mean"]
                cells = [
                    f"{a / base['answer_kl_mean']:.2f}×",
                    f"{f / base['first_token_kl_mean']:.2f}×",
                    f"≈{(1 - w) * r0 + w * r1:.3f}",
                ]
        lines.append(f"| {sel} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--offset", type=int, default=20, help="skip the first N questions")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--neighbours", type=int, default=2)
    ap.add_argument("--selectors", default=",".join(SELECTORS))
    ap.add_argument("--equal-ratios", default="0.1,0.08", help="lower ratios for the selectors")
    ap.add_argument("--temperatures", default="1.0,1.1")
    ap.add_argument("--scales", default="0.9,1.1,1.2")
    ap.add_argument("--scale-temperatures", default="1.0,1.06", help="T of the S variants")
    ap.add_argument("--repair-ratios", default="0.3,0.5")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--name", default="levers_smollm2_fp32")
    ap.add_argument("--out", required=True)
    return ap.parse_args()


def main() -> None:
    args = parse()
    fusor.cached_key_temper = scaled_temper  # the S lever; unchanged for every other selector
    # exact decode activations: the answer decoded and teacher-forced with the same arithmetic
    engine = BlendEngine.from_pretrained(args.model, dtype=args.dtype, decode_activations="float")
    cases = load_cases(
        args.dataset, engine.tokenizer, args.top_k, args.chunk_tokens, args.offset + args.limit
    )[args.offset :]
    source = dataset_neighbours("neighbours", args.dataset, engine.tokenizer, args.chunk_tokens)
    nb = {
        "precompute_context": "neighbours",
        "precompute_neighbours": args.neighbours,
        "neighbours": source,
        "store": MemoryStore(STORE_BYTES),
    }
    iso = {"precompute_context": "canonical", "store": MemoryStore(STORE_BYTES)}
    runs = variants(args, nb, iso)
    nb_view = engine.with_config(**nb)
    per_question: list[dict] = []
    repairs: list[dict] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, case in enumerate(cases):
        t0 = time.perf_counter()
        res = run_benchmark(engine, [case], runs, 1, args.max_new_tokens, progress=False)
        per_question.append(
            {
                name: {
                    **{k: m[k] for k in (*METRICS, *TIMES)},
                    "ttft": m["ttft_ms_median"],
                }
                for name, m in res["modes"].items()
            }
        )
        if args.repair_ratios:
            repairs.append(repair(engine, nb_view, case, args))
        results = summarize(per_question, repairs)
        results["settings"] = {**vars(args), "n": len(per_question)}
        results["settings"]["torch_threads"] = torch.get_num_threads()
        (out / f"{args.name}.json").write_text(json.dumps(results, indent=2))
        print(f"question {i + 1}/{len(cases)} in {time.perf_counter() - t0:.0f}s", flush=True)
    print(table(results))
    print(equal_ttft(results))


if __name__ == "__main__":
    main()
