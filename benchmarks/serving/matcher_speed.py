"""Speed of content-addressed chunk matching: an ~8k-token prompt against N known chunks.

Writes JSON with the index build time and the median / p95 match time. Chunks are synthetic
random-word passages (~2,000 characters, ~500 tokens); the prompt holds 12 of them (a typical
top-k) between template text, plus filler, about 32k characters (~8k tokens).

    python benchmarks/serving/matcher_speed.py --chunks 100000 --out out/matcher_speed.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from ragblend.matching import ChunkIndex, find_chunks, split_text

WORDS = [f"w{i}" for i in range(5000)] + ["the", "of", "and", "river", "city", "year"]


def passage(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=100_000)
    parser.add_argument("--chunk-chars", type=int, default=2000)
    parser.add_argument("--in-prompt", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default="out/matcher_speed.json")
    args = parser.parse_args()
    rng = random.Random(0)
    chunks = [f"doc {i}: " + passage(rng, args.chunk_chars) for i in range(args.chunks)]
    index = ChunkIndex()
    t0 = time.perf_counter()
    index.add(chunks)
    add_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    index.spans("warm")  # builds the automaton
    build_s = time.perf_counter() - t0
    picked = rng.sample(chunks, args.in_prompt)
    filler = passage(rng, 32_000 - sum(len(c) + 2 for c in picked))
    prompt = "Context information is below.\n---\n" + "\n\n".join(picked)
    prompt += "\n---\nGiven the context, answer.\nQuery: " + filler
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        split = split_text(prompt, find_chunks(prompt, index))
        times.append((time.perf_counter() - t0) * 1000)
    assert split is not None and split.chunks == picked, "matcher missed chunks"
    times.sort()
    result = {
        "known_chunks": len(index),
        "chunk_chars": args.chunk_chars,
        "prompt_chars": len(prompt),
        "chunks_in_prompt": args.in_prompt,
        "index_add_s": round(add_s, 3),
        "automaton_build_s": round(build_s, 3),
        "match_ms_median": round(statistics.median(times), 3),
        "match_ms_p95": round(times[int(0.95 * (len(times) - 1))], 3),
        "all_chunks_found": True,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
