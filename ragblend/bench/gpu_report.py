"""``benchmarks/gpu_bench.py``'s report: the console tables and the two plots per model shape."""

from __future__ import annotations

from pathlib import Path


def print_layout(shape: str, name: str, n_tokens: int, res: dict) -> None:
    print(f"\n[{shape}] layout {name} ({n_tokens} prompt tokens)", flush=True)
    print(f"  {'variant':<26}{'TTFT ms':>10}{'speedup':>9}{'recomp':>8}{'load ms':>9}")
    for vname, r in res.items():
        print(
            f"  {vname:<26}{r['ttft_ms_median']:>10.1f}{r['speedup_vs_full']:>9.2f}"
            f"{r['recomputed_fraction']:>8.3f}{r['load_ms_last']:>9.1f}"
        )


def print_rates(shape: str, rs: dict) -> None:
    print(
        f"\n[{shape}] request-rate sweep ({rs['layout']}, {rs['tier']} tier, blend "
        f"r={rs['ratio']}, {rs['requests_per_rate']} requests/rate)",
        flush=True,
    )
    print(f"  {'rate/s':>8}{'full mean TTFT':>16}{'blend mean TTFT':>17}")
    for f, b in zip(rs["curves"]["full"], rs["curves"]["blend"]):
        print(f"  {f['rate']:>8.2f}{f['mean_ttft_ms']:>16.1f}{b['mean_ttft_ms']:>17.1f}")
    for row in rs["throughput_at_equal_mean_ttft"]:
        ratio = row["throughput_ratio_blend_over_full"]
        print(
            f"  at mean TTFT ≤ {row['target_mean_ttft_ms']:.0f} ms: full "
            f"{row['full']['rate']:.2f}/s, blend {row['blend']['rate']:.2f}/s"
            + (f" ({ratio:.2f}×)" if ratio else "")
        )


def plot_shape(info: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shape = info["shape"]
    layouts = info.get("layouts", {})
    if layouts:
        fig, axes = plt.subplots(1, len(layouts), figsize=(5.5 * len(layouts), 4.5), squeeze=False)
        for ax, (name, lay) in zip(axes[0], layouts.items()):
            res = lay["variants"]
            tiers = sorted({r["tier"] for r in res.values() if r["tier"]})
            for i, tier in enumerate(tiers):
                color = f"C{i}"
                kernels = sorted({r.get("layer_kernels") or "hf" for r in res.values()})
                for kind in kernels:  # one line per layer-step kind (HF's modules, fused)
                    of_kind = [
                        r
                        for r in res.values()
                        if r["tier"] == tier and (r.get("layer_kernels") or "hf") == kind
                    ]
                    pts = sorted(
                        (r["ratio"], r["ttft_ms_median"])
                        for r in of_kind
                        if r["mode"] == "blend" and isinstance(r["ratio"], float)
                    )
                    reuse = [r["ttft_ms_median"] for r in of_kind if r["mode"] == "reuse"]
                    xs = ([0.0] if reuse else []) + [p[0] for p in pts]
                    ys = reuse + [p[1] for p in pts]
                    if xs:
                        style, label = ("o--", " fused") if kind == "fused" else ("o-", "")
                        ax.plot(xs, ys, style, color=color, label=f"reuse→blend [{tier}]{label}")
                for r in res.values():
                    if r["tier"] == tier and r["mode"] == "prefix":
                        ax.axhline(
                            r["ttft_ms_median"], color=color, ls=":", label=f"prefix [{tier}]"
                        )
                    if r["tier"] == tier and r["ratio"] == "auto":
                        x = r["effective_ratio"] or 1.0
                        ax.scatter(
                            [x],
                            [r["ttft_ms_median"]],
                            marker="*",
                            s=120,
                            color=color,
                            label=f"blend auto [{tier}]",
                        )
            if "full" in res:
                ax.axhline(res["full"]["ttft_ms_median"], color="k", ls="--", label="full")
            ax.set(
                title=f"{shape} · {name} ({lay['prompt_tokens']} tok)",
                xlabel="recompute ratio (0 = reuse)",
                ylabel="TTFT median (ms)",
            )
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"ttft_{shape}.png", dpi=120)
        plt.close(fig)
    rs = info.get("rate_sweep")
    if rs:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for mode, style in (("full", "s--"), ("blend", "o-")):
            pts = rs["curves"][mode]
            label = mode if mode == "full" else f"blend r={rs['ratio']}"
            ax.plot([p["rate"] for p in pts], [p["mean_ttft_ms"] for p in pts], style, label=label)
        for row in rs["throughput_at_equal_mean_ttft"]:
            ax.axhline(row["target_mean_ttft_ms"], color="grey", ls=":", lw=0.8)
        ax.set(
            xlabel="request rate (requests/s, Poisson)",
            ylabel="mean TTFT (ms)",
            title=f"{shape} · {rs['layout']} · {rs['tier']} tier · FIFO",
            xscale="log",
            yscale="log",
        )
        ax.grid(alpha=0.3, which="both")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"rate_{shape}.png", dpi=120)
        plt.close(fig)
