"""Plots for benchmark results (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path


def plot_ttft_vs_quality(results: dict, path: str | Path) -> None:
    """TTFT (x) against F1 and answer KL (y), one point per mode (paper Fig. 12 style)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = results["modes"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, m in modes.items():
        for ax, key in zip(axes, ("f1", "answer_kl_mean")):
            ax.scatter(m["ttft_ms_median"], m[key], s=60)
            ax.annotate(
                name, (m["ttft_ms_median"], m[key]), textcoords="offset points", xytext=(5, 5)
            )
    s = results.get("settings", {})
    title = f"{s.get('model', '')} · top-{s.get('top_k', '?')} × {s.get('chunk_tokens', '?')} tok"
    axes[0].set(xlabel="TTFT median (ms)", ylabel="F1", title=f"F1 vs TTFT — {title}")
    axes[1].set(
        xlabel="TTFT median (ms)",
        ylabel="answer KL to full (nats)",
        title="fidelity to full prefill (lower is better)",
    )
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
