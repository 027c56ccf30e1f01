"""Draw TTFT of full prefill vs blend from `ragblend bench` results (the README's picture).

    python benchmarks/plot_ttft.py benchmarks/results/intel-amx/bench_bf16 \
        benchmarks/results/intel-amx/bench_disk benchmarks/results/intel-amx/bench_fp32 \
        --out benchmarks/results/intel-amx/ttft_full_vs_blend.png

One pair of bars per results directory (its `results.json`): median TTFT of `full` and
`blend`, labelled with the dtype and tier from its settings and blend's speedup.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run: Path) -> tuple[str, float, float, float]:
    """(label, full ms, blend ms, speedup) of one `ragblend bench` results directory."""
    results = json.loads((run / "results.json").read_text())
    s, modes = results["settings"], results["modes"]
    label = f"{s['dtype']}, KV from {s['tier']}"
    speedup = results["speedup_vs_full"]["blend"]
    return label, modes["full"]["ttft_ms_median"], modes["blend"]["ttft_ms_median"], speedup


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="`ragblend bench --out` directories")
    ap.add_argument("--out", required=True, type=Path, help="PNG to write")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [load(run) for run in args.runs]
    fig, ax = plt.subplots(figsize=(7, 0.9 + 0.8 * len(rows)))
    for i, (label, full, blend, speedup) in enumerate(reversed(rows)):
        y = 2 * i
        ax.barh(y + 0.4, full, height=0.7, color="0.65", label="full prefill" if i == 0 else None)
        ax.barh(y - 0.4, blend, height=0.7, color="C0", label="blend" if i == 0 else None)
        ax.text(full, y + 0.4, f" {full:,.0f} ms", va="center", fontsize=8)
        ax.text(
            blend, y - 0.4, f" {blend:,.0f} ms ({speedup:.2f}× faster)", va="center", fontsize=8
        )
        ax.text(-0.01, y, label, transform=ax.get_yaxis_transform(), ha="right", va="center")
    ax.set_yticks([])
    ax.set_xlabel("time to first token, median (ms)")
    ax.set_xlim(0, 1.25 * max(r[1] for r in rows))
    ax.legend(loc="lower right", fontsize=8)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
