"""Print the loading controller's decisions (ratio, estimates, tier) for RAM and disk tiers.

python benchmarks/prefill/controller_decisions.py --tokens 3200 --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict

from ragblend import BlendEngine
from ragblend.controller import LoadingController
from ragblend.store import make_store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1600, 3200, 6400])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    decisions = {}
    for tier in ("ram", "disk"):
        store = make_store(tier, path=tempfile.mkdtemp(prefix="ragblend-ctl-"))
        engine = BlendEngine.from_pretrained(args.model, store=store)
        controller = LoadingController.for_engine(engine, refresh=True)
        decisions[tier] = [asdict(controller.decide(n)) for n in args.tokens]
        for d in decisions[tier]:
            print(
                f"{tier:>4}  L={d['n_tokens']:>5}  ratio={d['ratio']:.3f} (r*={d['r_star']}, "
                f"r_load={d['r_load']:.3f})  T_prefill={d['t_prefill_ms']:.0f} ms  "
                f"T_load={d['t_load_ms']:.0f} ms  T_recompute={d['t_recompute_ms']:.0f} ms  "
                f"bw={d['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s  "
                f"fallback_full={d['fallback_full']}"
            )
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(decisions, fh, indent=2)


if __name__ == "__main__":
    main()
