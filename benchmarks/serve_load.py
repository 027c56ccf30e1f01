"""Load on ``ragblend serve``: concurrent streaming clients, batched decode, TTFT under load.

    python benchmarks/serve_load.py --out benchmarks/results/serve_load.json

Starts ``ragblend serve`` in a subprocess on a free port (or uses ``--url``), warms the chunks
of the first ``--questions`` MuSiQue dev cases through ``POST /v1/ragblend/chunks``, then
measures, with OpenAI-format chat requests whose user message holds ``--top-k`` chunks:

- ``blend_vs_full``: the server's TTFT of the same request in blend and in full mode (interleaved,
  ``--repeats`` pairs), the mode that ran and its chunk hits;
- ``streaming_clients``: ``--clients`` concurrent streaming requests: errors, whether every
  stream ended with ``data: [DONE]``, client-side TTFTs;
- ``decode_throughput``: aggregate decode tokens/s of 4 and of 8 concurrent requests vs one
  alone (client-side, over the span in which every one of them is decoding), for the first of
  ``--prompt-sizes``; ``decode_throughput_by_prompt``: the same for each prompt size (by
  default ``6x512``, the chunks above, and ``6x150``: six passages of at most 150 tokens,
  ≈0.9k-token prompts; ``6xall`` sends six whole passages, uncut), with the prompt's tokens;
- ``ttft_under_load``: TTFT of a request arriving while 3 others decode vs a lone request's.

Every request uses ``temperature=0`` and ``ignore_eos`` so each decodes exactly ``--max-tokens``.
Run it on a quiet machine: the figures are timings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ragblend.config import DECODE_ACTIVATIONS, KV_CACHE_DTYPES

REPO = Path(__file__).resolve().parents[1]
DATASET = REPO.parent / "shared" / "data" / "musique_dev.json"
STREAM = {"stream": True, "stream_options": {"include_usage": True}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, store: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "ragblend.cli", "serve", "--model", args.model, "--port"]
    cmd += [str(port), "--store-path", store, "--dtype", args.dtype, "--max-running", "8"]
    cmd += ["--weights", args.weights, "--kv-cache-dtype", args.kv_cache_dtype]
    cmd += ["--decode-activations", args.decode_activations]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"ragblend serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("ragblend serve did not become healthy in 600 s")


def cases(args: argparse.Namespace, top_k: int, chunk_tokens: int) -> list[tuple[list[str], str]]:
    """(chunks, question) of the first --questions cases: the first ``top_k`` passages, each
    cut to ``chunk_tokens`` (0: whole) as `ragblend bench` does."""
    from transformers import AutoTokenizer

    from ragblend.bench.datasets import load_cases
    from ragblend.models.loading import model_dir

    tok = AutoTokenizer.from_pretrained(model_dir(args.model))
    cut = chunk_tokens or 10**9
    loaded = load_cases(args.dataset, tok, top_k, cut, args.questions)
    return [(list(c.chunks), c.question) for c in loaded]


def prompt_sizes(text: str) -> list[tuple[str, int, int]]:
    """``"6x512,6x150,6xall"`` → [(name, top_k, chunk_tokens (0: whole)), ...]."""
    sizes = []
    for spec in filter(None, (s.strip() for s in text.split(","))):
        k, _, n = spec.partition("x")
        if not k.isdigit() or not (n == "all" or n.isdigit()) or int(k) < 1:
            raise argparse.ArgumentTypeError(f"a prompt size is TOPKxTOKENS or TOPKxall: {spec}")
        sizes.append((spec, int(k), 0 if n == "all" else int(n)))
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one prompt size")
    return sizes


def chat_body(model: str, chunks: list[str], question: str, args, **extra) -> dict:
    context = "\n\n".join(chunks)
    messages = [
        {"role": "system", "content": "Answer the question from the passages, in a few words."},
        {"role": "user", "content": f"Passages:\n\n{context}\n\nQuestion: {question}"},
    ]
    body = {"model": model, "messages": messages, "max_tokens": args.max_tokens}
    return {**body, "temperature": 0, "ignore_eos": True, **extra}


async def stream_one(http: httpx.AsyncClient, body: dict) -> dict:
    """One streaming request: client-side TTFT, token times, [DONE], the ragblend object."""
    t0 = time.perf_counter()
    times: list[float] = []
    done, info, error, usage = False, None, None, {}
    try:
        async with http.stream("POST", "/v1/chat/completions", json={**body, **STREAM}) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]["message"]
                info = event.get("ragblend", info)
                usage = event.get("usage") or usage
                choices = event.get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    times.append(time.perf_counter())
    except httpx.HTTPError as exc:
        error = repr(exc)
    return {
        "ttft_s": times[0] - t0 if times else None,
        "times": times,  # when each content delta arrived (about one per token)
        "tokens": usage.get("completion_tokens", 0),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "done": done,
        "ragblend": info,
        "error": error,
    }


def rate(runs: list[dict]) -> float:
    """Deltas per second while every run decodes: from the last run's first token to the first
    run's last token (prefills of the others excluded)."""
    lo = max(r["times"][0] for r in runs)
    hi = min(r["times"][-1] for r in runs)
    n = sum(sum(1 for t in r["times"] if lo < t <= hi) for r in runs)
    return n / (hi - lo) if hi > lo else 0.0


async def throughput(http: httpx.AsyncClient, body: dict, args) -> tuple[dict, list[dict]]:
    """decode_throughput of ``body``: one request alone (``--repeats``) vs 4 and 8 at once;
    and the lone runs."""
    alone = [await stream_one(http, body) for _ in range(args.repeats)]
    four = rate(list(await asyncio.gather(*(stream_one(http, body) for _ in range(4)))))
    eight = rate(list(await asyncio.gather(*(stream_one(http, body) for _ in range(8)))))
    single = statistics.median(rate([r]) for r in alone)
    return {
        "single_tok_s": single,
        "four_concurrent_tok_s": four,
        "ratio": four / single if single else None,
        "eight_concurrent_tok_s": eight,
        "ratio_eight": eight / single if single else None,
    }, alone


async def warm(http: httpx.AsyncClient, work: list[tuple[list[str], str]]) -> dict:
    t0 = time.perf_counter()
    texts = list(dict.fromkeys(c for chunks, _ in work for c in chunks))
    warmed = (await http.post("/v1/ragblend/chunks", json={"texts": texts})).json()
    return {"chunks": len(texts), "seconds": time.perf_counter() - t0, **warmed}


async def measure(url: str, model: str, works: dict[str, list], args) -> dict:
    """Every measurement on the first prompt size; decode throughput on each."""
    name, work = next(iter(works.items()))
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        warmup = await warm(http, work)
        body = chat_body(model, *work[0], args)
        await stream_one(http, body)  # one request before the clocks (first-use costs)

        pairs = []
        for _ in range(args.repeats):
            row = {}
            for mode in ("blend", "full"):
                r = await http.post(
                    "/v1/chat/completions", json={**body, "ragblend": {"mode": mode}}
                )
                row[mode] = r.json()["ragblend"]
            pairs.append(row)
        blend_ms = statistics.median(p["blend"]["ttft_ms"] for p in pairs)
        full_ms = statistics.median(p["full"]["ttft_ms"] for p in pairs)

        bodies = [chat_body(model, *work[i % len(work)], args) for i in range(args.clients)]
        many = await asyncio.gather(*(stream_one(http, b) for b in bodies))

        decode, alone = await throughput(http, body, args)
        by_prompt = {name: {**decode, "prompt_tokens": alone[0]["prompt_tokens"]}}
        long = {**body, "max_tokens": 4 * args.max_tokens}
        busy = [asyncio.create_task(stream_one(http, long)) for _ in range(3)]
        while (await http.get("/health")).json()["running"] < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # all three are decoding
        loaded = await stream_one(http, body)
        await asyncio.gather(*busy)
        lone_ttft = statistics.median(r["ttft_s"] for r in alone)

        for other, other_work in list(works.items())[1:]:
            await warm(http, other_work)
            other_body = chat_body(model, *other_work[0], args)
            await stream_one(http, other_body)  # its prefix and chunks served once first
            other_decode, other_alone = await throughput(http, other_body, args)
            by_prompt[other] = {**other_decode, "prompt_tokens": other_alone[0]["prompt_tokens"]}
    return {
        "warmup": warmup,
        "blend_vs_full": {
            "ttft_ms_blend_median": blend_ms,
            "ttft_ms_full_median": full_ms,
            "speedup": full_ms / blend_ms if blend_ms else None,
            "blend_mode": pairs[0]["blend"]["mode"],
            "chunk_hits": pairs[0]["blend"]["chunk_hits"],
            "pairs": pairs,
        },
        "streaming_clients": {
            "clients": args.clients,
            "modes": sorted({(r["ragblend"] or {}).get("mode", "?") for r in many}),
            "errors": sum(1 for r in many if r["error"] or not r["done"]),
            "all_done": all(r["done"] for r in many),
            "ttft_s": [r["ttft_s"] for r in many],
        },
        "decode_throughput": decode,
        "decode_throughput_by_prompt": by_prompt,
        "ttft_under_load": {
            "lone_ttft_s": lone_ttft,
            "with_three_decoding_ttft_s": loaded["ttft_s"],
            "ratio": loaded["ttft_s"] / lone_ttft if lone_ttft and loaded["ttft_s"] else None,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--served-model", default=None, help="the name to request")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weights", default="auto", choices=("auto", "dequantize"))
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the server's decode-time K/V cache (ragblend serve --kv-cache-dtype)",
    )
    parser.add_argument(
        "--decode-activations",
        default="auto",
        choices=DECODE_ACTIVATIONS,
        help="what the server's decode steps multiply a GGUF's weights by",
    )
    parser.add_argument("--dataset", type=Path, default=DATASET)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument(
        "--prompt-sizes",
        type=prompt_sizes,
        default=None,
        help="comma-separated TOPKxTOKENS (TOKENS 'all': whole passages); decode throughput "
        "is measured for each, everything else for the first (default: "
        "{top-k}x{chunk-tokens},6x150)",
    )
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args()
    if args.prompt_sizes is None:
        first = f"{args.top_k}x{args.chunk_tokens}"
        args.prompt_sizes = prompt_sizes(first if first == "6x150" else f"{first},6x150")
    works = {name: cases(args, k, n) for name, k, n in args.prompt_sizes}
    with tempfile.TemporaryDirectory(prefix="ragblend-serve-load-") as store:
        proc, url = (None, args.url) if args.url else start_server(args, store)
        try:
            model = args.served_model or httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            results = asyncio.run(measure(url, model, works, args))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings["prompt_sizes"] = [name for name, _, _ in args.prompt_sizes]
    from ragblend.cpu import describe

    out = {"settings": {**settings, "server": model, **describe()}, **results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in out.items() if k != "settings"}, indent=2)[:3000])


if __name__ == "__main__":
    main()
