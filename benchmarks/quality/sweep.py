"""Sweep blend settings (ratio × selector × schedule × precompute context) against full prefill.

Every variant runs on the same questions, interleaved, and is scored by fidelity to full
prefill (first-token KL, teacher-forced answer KL, answer agreement) and TTFT. Writes
``OUT/sweep.json`` and ``OUT/sweep.png`` (answer KL vs TTFT speedup).

    python benchmarks/quality/sweep.py --dataset ../shared/data/musique_dev.json --limit 8 --out OUT
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ragblend import BlendEngine
from ragblend.bench import study
from ragblend.bench.harness import Variant, run_benchmark


def variants(which: str) -> list[Variant]:
    out = [Variant("full", "full"), Variant("reuse", "reuse")]
    if which in ("ratio", "all"):
        for r in (0.05, 0.1, 0.15, 0.25, 0.5):
            out.append(Variant(f"kv@L1 r={r}", "blend", {"ratio": r}))
        out.append(Variant("k@L1 r=0.15", "blend", {"ratio": 0.15, "deviation": "k"}))
    if which in ("selector", "all"):
        r = 0.15
        out += [
            Variant("v@L1", "blend", {"ratio": r, "deviation": "v"}),
            Variant("kv@L2", "blend", {"ratio": r, "check_layers": (2,)}),
            Variant(
                "kv@L1,2,3 (2,1.5,1)",
                "blend",
                {"ratio": r, "check_layers": (1, 2, 3), "check_scales": (2.0, 1.5, 1.0)},
            ),
            Variant(
                "kv@L1,3 (1.5,1)",
                "blend",
                {"ratio": r, "check_layers": (1, 3), "check_scales": (1.5, 1.0)},
            ),
            Variant("random@L1", "blend", {"ratio": r, "selector": "random"}),
            Variant("ctx=bos kv@L1", "blend", {"ratio": r, "precompute_context": "bos"}),
            Variant("ctx=none kv@L1", "blend", {"ratio": r, "precompute_context": "none"}),
            Variant("ctx=bos reuse", "reuse", {"precompute_context": "bos"}),
        ]
    if which in ("query", "all"):
        for sel in ("kv-deviation", "attention", "kv-attention"):
            for r in (0.1, 0.15):
                out.append(Variant(f"{sel} r={r}", "blend", {"ratio": r, "selector": sel}))
    if which in ("budget", "all"):
        r = 0.15
        out += [
            Variant("kv r=0.15", "blend", {"ratio": r}),
            Variant("kv-relative r=0.15", "blend", {"ratio": r, "selector": "kv-relative"}),
            Variant(
                "kv L1,10 (1.5,.7)",
                "blend",
                {"ratio": r, "check_layers": (1, 10), "check_scales": (1.5, 0.7)},
            ),
            Variant(
                "kv L1,6 (2,.75)",
                "blend",
                {"ratio": r, "check_layers": (1, 6), "check_scales": (2.0, 0.75)},
            ),
            Variant(
                "kv L1,16 (1.3,.65)",
                "blend",
                {"ratio": r, "check_layers": (1, 16), "check_scales": (1.3, 0.65)},
            ),
        ]
    if which in ("context", "all"):
        for r in (0.1, 0.15):
            out.append(Variant(f"prefix r={r}", "blend", {"ratio": r}))
            out.append(
                Variant(f"filler r={r}", "blend", {"ratio": r, "precompute_context": "filler"})
            )
        out.append(Variant("filler reuse", "reuse", {"precompute_context": "filler"}))
    if which in ("final", "all"):
        r = 0.15
        out += [
            Variant("kv@L1", "blend", {"ratio": r}),
            Variant("v@L1", "blend", {"ratio": r, "deviation": "v"}),
            Variant(
                "kv@L1,10 (1.5,.7)",
                "blend",
                {"ratio": r, "check_layers": (1, 10), "check_scales": (1.5, 0.7)},
            ),
            Variant(
                "v@L1,10 (1.5,.7)",
                "blend",
                {"ratio": r, "deviation": "v", "check_layers": (1, 10), "check_scales": (1.5, 0.7)},
            ),
            Variant(
                "kv@L1,6,12 (2,1,.6)",
                "blend",
                {"ratio": r, "check_layers": (1, 6, 12), "check_scales": (2.0, 1.0, 0.6)},
            ),
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    study.add_case_arguments(ap, offset=0, limit=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--which",
        default="all",
        choices=("ratio", "selector", "query", "budget", "context", "final", "all"),
    )
    ap.add_argument("--model", default="embedded")
    study.add_output_arguments(ap)
    args = ap.parse_args()

    engine = BlendEngine.from_pretrained(args.model)
    cases = study.cases(args, engine.tokenizer)
    results = run_benchmark(engine, cases, variants(args.which), args.repeats, args.max_new_tokens)
    results["settings"] = {**vars(args), "n": len(cases), "torch_threads": torch.get_num_threads()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "sweep.png")
    print(f"{'variant':<28}{'speedup':>9}{'recomp':>8}{'ans_KL':>8}{'1st_KL':>8}{'agree':>7}")
    for name, m in results["modes"].items():
        sp = results["speedup_vs_full"].get(name, 1.0)
        print(
            f"{name:<28}{sp:>9.2f}{m['recomputed_fraction_mean']:>8.3f}"
            f"{m['answer_kl_mean']:>8.3f}{m['first_token_kl_mean']:>8.3f}"
            f"{m['agreement_with_full']:>7.2f}"
        )


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, m in results["modes"].items():
        if name == "full":
            continue
        x = m["recomputed_fraction_mean"]
        for ax, key in zip(axes, ("answer_kl_mean", "first_token_kl_mean")):
            marker = "s" if name.startswith("k@") else ("^" if "reuse" in name else "o")
            ax.scatter(x, m[key], marker=marker)
            ax.annotate(name, (x, m[key]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    axes[0].set(xlabel="recomputed fraction (∝ compute)", ylabel="answer KL to full (nats)")
    axes[1].set(xlabel="recomputed fraction (∝ compute)", ylabel="first-token KL to full")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("blend settings: fidelity vs compute (lower-left is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
