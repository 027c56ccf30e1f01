"""Decode tokens/s of ragblend and llama.cpp on the same GGUF, context and threads, interleaved.

    python benchmarks/decode_vs_llamacpp.py --gguf model-Q4_K_M.gguf [--gguf ...] \\
        [--rounds 5] [--tokens 16] [--decode-activations float,int8] [--dataset PATH] \\
        --out out/decode_vs_llamacpp.json

Per GGUF, one process holds both: ragblend (``BlendEngine.from_pretrained(gguf)``, defaults:
blocks kept, ``auto`` dtype) and llama-cpp-python (``ragblend.bench.llamacpp``: n_batch 512,
flash attention, the CPU's repacked buffers where they work). Both prefill the same prompt ids
in full (6 MuSiQue chunks of <= 512 tokens and the question: about 3.2k tokens), then decode
greedily in turns, ``--tokens`` tokens each per round: ragblend from its prefill each time,
llama.cpp going on from where it stopped (its context grows by ``--tokens`` per round, a few
tokens in 3.2k). A noisy neighbour hits both alike; the ratio reported is the median of the
per-round ratios. ``--decode-activations`` (``BlendConfig.decode_activations``; a comma list
times each in the same rounds, e.g. ``float,int8``; default ``auto``), ``--kv-cache-dtype``
(``BlendConfig.kv_cache_dtype``, default ``auto``). Writes
``{"settings": {...}, "models": {name: {"context_tokens", "decode_path", "ragblend_tok_s",
"llamacpp_tok_s", "ratio", "rounds": [...], "activations": {setting: {"decode_path",
"ragblend_tok_s", "ratio"}}}}}``; the top-level figures are the first setting's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ragblend import BlendConfig, BlendEngine, SamplingParams
from ragblend.bench import llamacpp as peer
from ragblend.bench.datasets import default_dataset, load_cases
from ragblend.config import DECODE_ACTIVATIONS, KV_CACHE_DTYPES
from ragblend.cpu import describe
from ragblend.decode.generation import decode_tokens


def measure(
    gguf: Path, dataset: Path, rounds: int, tokens: int, modes: list[str], kv_cache_dtype: str
) -> dict:
    """Interleaved decode rounds of ragblend (each of ``modes``, a ``decode_activations``
    setting; its decode K/V cache as ``kv_cache_dtype``) and llama.cpp on ``gguf`` (see the
    module doc)."""
    config = BlendConfig(kv_cache_dtype=kv_cache_dtype)  # type: ignore[arg-type]
    engine = BlendEngine.from_pretrained(str(gguf), config=config)
    case = load_cases(dataset, engine.tokenizer, 6, 512, 1)[0]
    prompt = engine.tokenize(case.question, case.chunks)
    ids = [int(i) for i in prompt.ids]
    prefill = engine.prefill(prompt, "full")
    views = {mode: engine.with_config(decode_activations=mode) for mode in modes}
    for view in views.values():
        view.prepare_decode()
    llm = peer.LlamaCppPeer(
        gguf,
        len(ids) + (rounds + 1) * len(modes) * tokens + 16,
        peer.PeerSetting(n_batch=512, flash_attn=True),
        threads=torch.get_num_threads(),
    )
    llm.ttft_ms(ids)

    def ours(view: BlendEngine) -> float:
        start = time.perf_counter()
        steps = decode_tokens(
            view.model,
            prefill,
            SamplingParams(),
            tokens + 1,
            set(),
            view.layers,
            view.native,
            kv_cache_dtype=kv_cache_dtype,
            activations=view.decode_activations,
        )
        count = sum(1 for _ in steps) - 1  # the first token comes from the prefill's logits
        return count / (time.perf_counter() - start)

    def round_() -> dict[str, float]:
        times = {mode: ours(view) for mode, view in views.items()}
        return {**times, "llamacpp": llm.decode_on(tokens)}

    try:
        # warm-up: the first steps after a switch bring the weights back into the caches
        round_()
        runs = [round_() for _ in range(rounds)]
    finally:
        llm.close()
    per_mode = {
        mode: {
            "decode_path": view.decode_path,
            "ragblend_tok_s": statistics.median(r[mode] for r in runs),
            "ratio": statistics.median(r[mode] / r["llamacpp"] for r in runs),
        }
        for mode, view in views.items()
    }
    first = per_mode[modes[0]]
    return {
        "context_tokens": len(ids),
        "decode_path": first["decode_path"],
        "ragblend_tok_s": first["ragblend_tok_s"],
        "llamacpp_tok_s": statistics.median(r["llamacpp"] for r in runs),
        "ratio": first["ratio"],
        "rounds": runs,
        "activations": per_mode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", action="append", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument(
        "--decode-activations",
        default="auto",
        help="BlendConfig.decode_activations: auto, float or int8, or a comma list to compare",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="BlendConfig.kv_cache_dtype: ragblend's decode-time K/V cache",
    )
    parser.add_argument("--dataset", type=Path, default=default_dataset())
    parser.add_argument("--out", type=Path, default=Path("out/decode_vs_llamacpp.json"))
    args = parser.parse_args()
    modes = [m.strip() for m in args.decode_activations.split(",") if m.strip()]
    if not modes or any(m not in DECODE_ACTIVATIONS for m in modes):
        parser.error(f"--decode-activations takes {', '.join(DECODE_ACTIVATIONS)} (comma list)")
    if not peer.available():
        parser.error("llama-cpp-python is not installed (see benchmarks/README.md)")
    results: dict = {
        "settings": {
            "rounds": args.rounds,
            "tokens": args.tokens,
            "decode_activations": modes,
            "kv_cache_dtype": args.kv_cache_dtype,
            "dataset": str(args.dataset),
            "torch_threads": torch.get_num_threads(),
            **describe(),
        },
        "models": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for gguf in args.gguf:
        results["models"][gguf.name] = measure(
            gguf, args.dataset, args.rounds, args.tokens, modes, args.kv_cache_dtype
        )
        print(gguf.name, json.dumps(results["models"][gguf.name]), flush=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
