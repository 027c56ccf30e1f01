"""Answer fidelity of the decode numerics modes against the exact decode, per token.

    python benchmarks/decode/decode_numerics_kl.py --model embedded --first 20 --count 10 \\
        --variants int8/auto,float/int8,int8/int8 --out out/decode_numerics_kl.json

A variant is ``ACTIVATIONS/KV_CACHE`` (``BlendConfig.decode_activations`` /
``kv_cache_dtype``); the reference is ``float/auto`` (a GGUF's quantized linears on exact
activations, the K/V cache in the model's dtype). Per dev question (top ``--top-k`` chunks of
``--chunk-tokens``, one full prefill, shared by all): the reference's greedy answer and its
logits at every step; then, per variant, a decoder of the variant teacher-forced on that answer
(KL(reference ‖ variant) per answer token: the first token's logits are the prefill's, so its
KL is 0 and counted, as ``bench``'s ``answer_kl_mean`` counts every answer token; the mean
after the first is reported too), top-1 agreement under teacher forcing, and the variant's own
greedy answer: ``greedy_same`` is the share of questions whose greedy answer is the
reference's token for token, ``greedy_agreement`` the share of the reference's answer tokens
the variant's greedy answer matches position by position.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from ragblend import BlendConfig, BlendEngine
from ragblend.bench.datasets import default_dataset, load_cases
from ragblend.bench.environment import cpu_environment, write_report
from ragblend.bench.metrics import kl_divergence
from ragblend.config import DECODE_ACTIVATIONS, KV_CACHE_DTYPES
from ragblend.decode.generation import Prefill

REFERENCE = ("float", "auto")


def greedy(engine: BlendEngine, prefill: Prefill, max_new: int) -> tuple[list[int], torch.Tensor]:
    """``engine``'s greedy answer ids after ``prefill`` (EOS excluded) and the fp32 logits
    [len(ids), V] each was chosen from."""
    decoder = engine.decoder(prefill, max_new + 1)
    rows, ids = [prefill.logits.float().view(-1)], list[int]()
    while len(ids) < max_new:
        token = int(rows[-1].argmax())
        if token in engine.eos_ids:
            break
        ids.append(token)
        rows.append(decoder.step(token))
    return ids, torch.stack(rows[: len(ids)])


def forced(engine: BlendEngine, prefill: Prefill, ids: list[int]) -> torch.Tensor:
    """fp32 logits [len(ids), V] predicting each of ``ids`` after ``prefill``, one decode step
    of ``engine`` per token."""
    decoder = engine.decoder(prefill, len(ids) + 1)
    rows = [prefill.logits.float().view(-1)] + [decoder.step(t) for t in ids[:-1]]
    return torch.stack(rows)


def parse_variants(text: str) -> list[tuple[str, str]]:
    """``"int8/auto,float/int8"`` -> [("int8", "auto"), ("float", "int8")]; ValueError if bad."""
    variants = []
    for item in text.split(","):
        activations, _, kv = item.strip().partition("/")
        if activations not in DECODE_ACTIVATIONS or kv not in KV_CACHE_DTYPES:
            raise ValueError(
                f"variant {item!r}: ACTIVATIONS/KV_CACHE with ACTIVATIONS one of "
                f"{', '.join(DECODE_ACTIVATIONS)} and KV_CACHE one of {', '.join(KV_CACHE_DTYPES)}"
            )
        variants.append((activations, kv))
    return variants


def compare(
    views: dict[str, BlendEngine], prefill: Prefill, max_new: int
) -> dict[str, dict[str, float]] | None:
    """Per variant name, its figures against the reference on one prefill (None where the
    reference's answer is empty)."""
    ids, reference = greedy(views["float/auto"], prefill, max_new)
    if not ids:
        return None
    rows = {}
    for name, view in views.items():
        if name == "float/auto":
            continue
        logits = forced(view, prefill, ids)
        kl = kl_divergence(reference, logits)
        own, _ = greedy(view, prefill, max_new)
        matched = sum(a == b for a, b in zip(own, ids))
        rows[name] = {
            "answer_tokens": len(ids),
            "answer_kl_mean": float(kl.mean()),
            "kl_after_first_mean": float(kl[1:].mean()) if len(ids) > 1 else 0.0,
            "kl_max": float(kl.max()),
            "top1_agreement": float((logits.argmax(-1) == torch.tensor(ids)).float().mean()),
            "greedy_same": float(own == ids),
            "greedy_agreement": matched / len(ids),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--variants", default="int8/auto,float/int8,int8/int8")
    parser.add_argument("--dataset", default=str(default_dataset()))
    parser.add_argument("--first", type=int, default=20, help="index of the first question")
    parser.add_argument("--count", type=int, default=10)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default="out/decode_numerics_kl.json")
    args = parser.parse_args()
    try:
        variants = [REFERENCE, *parse_variants(args.variants)]
    except ValueError as exc:
        parser.error(str(exc))
    engine = BlendEngine.from_pretrained(args.model, config=BlendConfig(dtype=args.dtype))
    views = {
        f"{a}/{kv}": engine.with_config(decode_activations=a, kv_cache_dtype=kv)
        for a, kv in variants
    }
    for view in views.values():
        view.prepare_decode()
    limit = args.first + args.count
    cases = load_cases(args.dataset, engine.tokenizer, args.top_k, args.chunk_tokens, limit)
    if len(cases) <= args.first:
        parser.error(f"{args.dataset} has {len(cases)} usable questions; --first is {args.first}")
    per_question: list[dict] = []
    for index, case in enumerate(cases[args.first :], start=args.first):
        prefill = engine.prefill(engine.tokenize(case.question, case.chunks), "full")
        rows = compare(views, prefill, args.max_new_tokens)
        if rows is not None:
            per_question.append({"question": index, "prompt_tokens": len(prefill.prompt_ids)})
            per_question[-1]["variants"] = rows
            print(index, rows, flush=True)
    summary = {}
    for name in views:
        if name == "float/auto" or not per_question:
            continue
        figures = [q["variants"][name] for q in per_question]
        summary[name] = {k: statistics.mean(f[k] for f in figures) for k in figures[0]}
        summary[name]["kl_max"] = max(f["kl_max"] for f in figures)
        summary[name]["resolved"] = views[name].decode_activations
        summary[name]["n"] = len(figures)
    print(summary)
    report = {
        "benchmark": "decode_numerics_kl",
        "settings": {
            "model": args.model,
            "dtype": str(engine.layers.dtype).removeprefix("torch."),
            "decode_path": views["float/auto"].decode_path,
            "dataset": Path(args.dataset).name,
            "questions": [args.first, limit],
            "top_k": args.top_k,
            "chunk_tokens": args.chunk_tokens,
            "max_new_tokens": args.max_new_tokens,
            "mode": "full",
            "reference": "float/auto",
            "variants": [f"{a}/{kv}" for a, kv in variants[1:]],
        },
        **cpu_environment(),
        "summary": summary,
        "questions": per_question,
    }
    write_report(Path(args.out), report)


if __name__ == "__main__":
    main()
