"""Which precompute context should chunk caches use? Exact prompt head vs template-independent ones.

``prefix`` keys every chunk by the user's exact prompt head (template + system prompt), so a
chunk hits only under the template it was warmed with; ``canonical`` (the chat template's head
with a fixed neutral system prompt) and ``bos`` are template-independent. All variants run on the
same held-out questions, interleaved, scored by fidelity to full prefill. Writes
``OUT/context_choice.json``.

    python benchmarks/context_choice.py --dataset ../shared/data/musique_dev.json --offset 20 \
        --limit 8 --out benchmarks/results/intel-amx
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ragblend import BlendConfig, BlendEngine
from ragblend.bench.datasets import load_cases
from ragblend.bench.harness import Variant, run_benchmark

CONTEXTS = ("prefix", "canonical", "bos")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--offset", type=int, default=20)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    engine = BlendEngine.from_pretrained("embedded", config=BlendConfig(dtype=args.dtype))
    cases = load_cases(
        args.dataset, engine.tokenizer, args.top_k, args.chunk_tokens, args.offset + args.limit
    )[args.offset :]
    variants = [Variant("full", "full")]
    for ctx in CONTEXTS:
        variants.append(Variant(f"{ctx} reuse", "reuse", {"precompute_context": ctx}))
        variants.append(Variant(f"{ctx} blend", "blend", {"precompute_context": ctx}))
    results = run_benchmark(engine, cases, variants, 1, args.max_new_tokens)
    results["settings"] = {
        **vars(args),
        "n": len(cases),
        "ratio": engine.config.ratio,
        "torch_threads": torch.get_num_threads(),
    }
    table = {}
    for ctx in CONTEXTS:
        blend, reuse = results["modes"][f"{ctx} blend"], results["modes"][f"{ctx} reuse"]
        table[ctx] = {
            "blend_answer_kl": blend["answer_kl_mean"],
            "blend_first_token_kl": blend["first_token_kl_mean"],
            "blend_agreement": blend["agreement_with_full"],
            "reuse_answer_kl": reuse["answer_kl_mean"],
            "reuse_first_token_kl": reuse["first_token_kl_mean"],
            "blend_answer_kl_vs_prefix": None,
        }
    for ctx in CONTEXTS:
        table[ctx]["blend_answer_kl_vs_prefix"] = (
            table[ctx]["blend_answer_kl"] / table["prefix"]["blend_answer_kl"]
        )
    results["table"] = table
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "context_choice.json").write_text(json.dumps(results, indent=2))
    print(
        f"{'context':<11}{'blend ansKL':>12}{'vs prefix':>10}{'blend 1stKL':>12}"
        f"{'agree':>7}{'reuse ansKL':>12}"
    )
    for ctx, row in table.items():
        print(
            f"{ctx:<11}{row['blend_answer_kl']:>12.4f}{row['blend_answer_kl_vs_prefix']:>10.3f}"
            f"{row['blend_first_token_kl']:>12.4f}{row['blend_agreement']:>7.2f}"
            f"{row['reuse_answer_kl']:>12.4f}"
        )


if __name__ == "__main__":
    main()
