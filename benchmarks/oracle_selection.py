"""How good can token selection get? Oracle selectors vs layer-1 KV deviation vs reuse.

For each question, a real full prefill gives every token's true KV deviation on every layer
(full vs reused cache). Oracle selectors pick the top-r tokens by that deviation (summed over
all layers, over layers ≥ 10, or on layer 1 alone) at check layer 1; the printed numbers are
teacher-forced answer KL to full prefill, the sparsity of the deviation (share of the total
held by the top-r tokens) and the Spearman correlation between layer-1 and total deviation.

    python benchmarks/oracle_selection.py --dataset ../shared/data/musique_dev.json \
        --offset 20 --limit 6
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from ragblend import BlendEngine
from ragblend.bench.datasets import load_cases
from ragblend.bench.metrics import kl_divergence


class FixedScores:
    """Selector returning precomputed per-position scores."""

    name = "oracle"

    def __init__(self, scores: torch.Tensor) -> None:
        self.values = scores

    def scores(self, check) -> torch.Tensor:
        return self.values[check.rows]


def _rank(x: torch.Tensor) -> torch.Tensor:
    return x.argsort().argsort().float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--offset", type=int, default=20)
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # exact decode activations: the answer decoded and teacher-forced with the same arithmetic
    base = BlendEngine.from_pretrained("embedded", decode_activations="float")
    engine = base.with_config(ratio=args.ratio, check_layers=(1,), check_scales=None)
    cases = load_cases(args.dataset, engine.tokenizer, 6, 512, args.offset + args.limit)
    results: dict[str, list[float]] = {}
    for case in cases[args.offset :]:
        engine.precompute(case.chunks)
        prompt = engine.tokenize(case.question, case.chunks)
        full = engine.prefill(prompt, "full")
        answer = engine.greedy_answer(full, 24)
        ref = engine.teacher_forced_logits(full, answer)
        reuse = engine.prefill(prompt, "reuse")
        devs = []
        for layer in range(engine.layers.num_layers):
            f, r = full.cache.layers[layer], reuse.cache.layers[layer]
            dk = (f.keys.float() - r.keys.float()).pow(2).sum((0, 1, 3))
            dv = (f.values.float() - r.values.float()).pow(2).sum((0, 1, 3))
            devs.append(dk / dk.mean().clamp_min(1e-12) + dv / dv.mean().clamp_min(1e-12))
        devs = torch.stack(devs)
        chunk_rows = torch.zeros(len(prompt.ids), dtype=torch.bool)
        start = len(prompt.head)
        for i, chunk in enumerate(prompt.chunks):
            start += len(prompt.separator) if i else 0
            chunk_rows[start : start + len(chunk)] = True
            start += len(chunk)
        total = devs.sum(0)
        chunk_total = total[chunk_rows]
        top = chunk_total.topk(int(args.ratio * chunk_total.numel())).values.sum()
        results.setdefault("top_r_share_of_deviation", []).append(float(top / chunk_total.sum()))
        ranks = torch.stack([_rank(devs[1][chunk_rows]), _rank(chunk_total)])
        spearman = float(torch.corrcoef(ranks)[0, 1])
        results.setdefault("spearman_layer1_vs_total", []).append(spearman)
        runs = {"reuse": reuse, "blend (layer-1 deviation)": engine.prefill(prompt, "blend")}
        for name, scores in (
            ("oracle: total deviation", total),
            ("oracle: deviation on layers >= 10", devs[10:].sum(0)),
        ):
            view = engine.with_config(selector=FixedScores(scores))
            runs[name] = view.prefill(prompt, "blend")
        for name, pre in runs.items():
            kl = kl_divergence(ref, engine.teacher_forced_logits(pre, answer)).mean()
            results.setdefault(f"answer_kl: {name}", []).append(float(kl))
    summary = {k: statistics.fmean(v) for k, v in results.items()}
    summary["n"] = len(cases) - args.offset
    summary["ratio"] = args.ratio
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"summary": summary, "per_question": results}, fh, indent=2)


if __name__ == "__main__":
    main()
