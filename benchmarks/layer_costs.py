"""Per-layer cost of each step of the fusion loop on the embedded model, fp32 vs bf16.

    .venv/bin/python benchmarks/layer_costs.py --tokens 3200 --rows 480

Times (median of interleaved repeats) one layer's: projection of the active rows, RoPE of all
cached keys (what fuse() does on every layer today), RoPE of only the active rows, the K/V
scatter of the active rows, row attention, and o_proj+MLP. Shapes follow a top-6 × 512 prompt at
r = 0.15. Shows which non-GEMM steps are worth removing from the fusor loop.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ragblend import BlendConfig, BlendEngine
from ragblend.fusion.attention import RowAttentionPlan, attend_rows


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.inference_mode()
def measure(name: str, args: argparse.Namespace) -> dict[str, float]:
    """Median ms per step of one layer in compute dtype ``name``."""
    m = BlendEngine.from_pretrained("embedded", config=BlendConfig(dtype=name)).layers
    n, hkv, d = args.tokens, m.num_kv_heads, m.head_dim
    active = torch.randperm(n)[: args.rows].sort().values
    positions = torch.arange(n)
    hidden = torch.randn(1, args.rows, m.hidden_size, dtype=m.dtype)
    cos, sin = m.rope(positions, hidden)
    k_cached = torch.randn(1, hkv, n, d, dtype=m.dtype)
    v_cached = torch.randn(1, hkv, n, d, dtype=m.dtype)
    proj = m.project(1, hidden, cos[:, active], sin[:, active])
    plan = RowAttentionPlan(active, m.num_heads // hkv, m.dtype, None)
    k_full = m.rotate(k_cached, cos, sin)
    attn = attend_rows(proj.q, k_full, v_cached, plan, m.scaling(1))

    def scatter():
        k_full[:, :, active] = proj.k
        v_cached[:, :, active] = proj.v

    steps = {
        "project(active)": lambda: m.project(1, hidden, cos[:, active], sin[:, active]),
        "rotate(all cached)": lambda: m.rotate(k_cached, cos, sin),
        "rotate_(all, in place)": lambda: m.rotate_(k_cached.clone(), cos, sin),
        "clone (cost in line above)": lambda: k_cached.clone(),
        "scatter via index_copy_": lambda: (
            k_full.index_copy_(2, active, proj.k),
            v_cached.index_copy_(2, active, proj.v),
        ),
        "rotate(active only)": lambda: m.rotate(
            k_cached[:, :, active], cos[:, active], sin[:, active]
        ),
        "scatter k,v": scatter,
        "attend_rows": lambda: attend_rows(proj.q, k_full, v_cached, plan, m.scaling(1)),
        "finish(o_proj+mlp)": lambda: m.finish(1, hidden, attn),
        "plan (masks)": lambda: RowAttentionPlan(active, m.num_heads // hkv, m.dtype, None),
    }
    for fn in steps.values():
        fn()
    res = {k: [] for k in steps}
    for _ in range(3):
        for k, fn in steps.items():
            res[k].append(timed(fn, args.repeats))
    return {k: statistics.median(v) for k, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3200)
    ap.add_argument("--rows", type=int, default=480)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args()
    torch.manual_seed(0)
    results = {name: measure(name, args) for name in args.dtypes.split(",")}
    print(f"threads {torch.get_num_threads()}, N={args.tokens}, rows={args.rows}, ms per layer:")
    names = list(results)
    print(f"  {'step':<22}" + "".join(f"{n:>11}" for n in names))
    for step in next(iter(results.values())):
        print(f"  {step:<22}" + "".join(f"{results[n][step]:11.3f}" for n in names))


if __name__ == "__main__":
    main()
