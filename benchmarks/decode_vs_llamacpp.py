"""Decode tokens/s of ragblend and llama.cpp on the same GGUF, context and threads, interleaved.

    python benchmarks/decode_vs_llamacpp.py --gguf model-Q4_K_M.gguf [--gguf ...] \\
        [--rounds 5] [--tokens 16] [--dataset PATH] --out out/decode_vs_llamacpp.json

Per GGUF, one process holds both: ragblend (``BlendEngine.from_pretrained(gguf)``, defaults:
blocks kept, ``auto`` dtype) and llama-cpp-python (``ragblend.bench.llamacpp``: n_batch 512,
flash attention, the CPU's repacked buffers where they work). Both prefill the same prompt ids
in full (6 MuSiQue chunks of <= 512 tokens and the question: about 3.2k tokens), then decode
greedily in turns, ``--tokens`` tokens each per round: ragblend from its prefill each time,
llama.cpp going on from where it stopped (its context grows by ``--tokens`` per round, a few
tokens in 3.2k). A noisy neighbour hits both alike; the ratio reported is the median of the
per-round ratios. Writes ``{"settings": {...}, "models": {name: {"context_tokens",
"decode_path", "ragblend_tok_s", "llamacpp_tok_s", "ratio", "rounds": [...]}}}``.
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
from ragblend.cpu import describe
from ragblend.generation import decode_tokens


def measure(gguf: Path, dataset: Path, rounds: int, tokens: int) -> dict:
    """Interleaved decode rounds of ragblend and llama.cpp on ``gguf`` (see the module doc)."""
    engine = BlendEngine.from_pretrained(str(gguf), config=BlendConfig())
    case = load_cases(dataset, engine.tokenizer, 6, 512, 1)[0]
    prompt = engine.tokenize(case.question, case.chunks)
    ids = [int(i) for i in prompt.ids]
    prefill = engine.prefill(prompt, "full")
    engine.prepare_decode()
    llm = peer.LlamaCppPeer(
        gguf,
        len(ids) + (rounds + 1) * tokens + 16,
        peer.PeerSetting(n_batch=512, flash_attn=True),
        threads=torch.get_num_threads(),
    )
    llm.ttft_ms(ids)

    def ours() -> float:
        start = time.perf_counter()
        steps = decode_tokens(
            engine.model,
            prefill,
            SamplingParams(),
            tokens + 1,
            set(),
            engine.layers,
            engine.native,
        )
        count = sum(1 for _ in steps) - 1  # the first token comes from the prefill's logits
        return count / (time.perf_counter() - start)

    try:
        # warm-up: the first steps after a switch bring the weights back into the caches
        ours(), llm.decode_on(tokens)
        runs = [{"ragblend": ours(), "llamacpp": llm.decode_on(tokens)} for _ in range(rounds)]
    finally:
        llm.close()
    return {
        "context_tokens": len(ids),
        "decode_path": engine.decode_path,
        "ragblend_tok_s": statistics.median(r["ragblend"] for r in runs),
        "llamacpp_tok_s": statistics.median(r["llamacpp"] for r in runs),
        "ratio": statistics.median(r["ragblend"] / r["llamacpp"] for r in runs),
        "rounds": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", action="append", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--dataset", type=Path, default=default_dataset())
    parser.add_argument("--out", type=Path, default=Path("out/decode_vs_llamacpp.json"))
    args = parser.parse_args()
    if not peer.available():
        parser.error("llama-cpp-python is not installed (see benchmarks/README.md)")
    results: dict = {
        "settings": {
            "rounds": args.rounds,
            "tokens": args.tokens,
            "dataset": str(args.dataset),
            "torch_threads": torch.get_num_threads(),
            **describe(),
        },
        "models": {},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for gguf in args.gguf:
        results["models"][gguf.name] = measure(gguf, args.dataset, args.rounds, args.tokens)
        print(gguf.name, json.dumps(results["models"][gguf.name]), flush=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
