"""Two processes share one Redis KV tier: one warms the chunks, the other answers with hits.

    python examples/two_process_shared_tier.py [--dataset PATH] [--questions 2] [--redis-url URL]

Without ``--redis-url`` a throwaway ``redis-server`` is started on a free loopback port. The
first child process precomputes the retrieved passages of each question into Redis (what
``ragblend warmup --redis-url`` or ``--ray`` does at scale); the second, a separate process with
its own copy of the model, answers the questions through a RAM → Redis chain: every chunk is a
hit fetched from Redis layer by layer, and its TTFT is printed next to a full prefill's.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ragblend.bench.datasets import default_dataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATASET = default_dataset()  # ../shared's dev cases, else the 4 shipped with ragblend


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", type=Path, default=DEFAULT_DATASET, help="MuSiQue-format JSON")
    p.add_argument("--questions", type=int, default=2, help="questions to answer")
    p.add_argument("--top-k", type=int, default=6, help="passages per question")
    p.add_argument("--chunk-tokens", type=int, default=512, help="cut each passage to N tokens")
    p.add_argument("--model", default="embedded", help="'embedded' or a local HF model dir")
    p.add_argument("--redis-url", default=None, help="a running Redis/Valkey (default: start one)")
    p.add_argument("--namespace", default="example", help="tenant namespace of the entries")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--role", choices=("warm", "query"), default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def cases(args: argparse.Namespace, tokenizer):
    from ragblend.bench.datasets import load_cases

    return load_cases(args.dataset, tokenizer, args.top_k, args.chunk_tokens, args.questions)


def engine(args: argparse.Namespace, store):
    from ragblend import BlendConfig, BlendEngine

    config = BlendConfig(namespace=args.namespace)
    return BlendEngine.from_pretrained(args.model, config=config, store=store)


def warm(args: argparse.Namespace) -> None:
    from ragblend.store.redis import RedisStore

    store = RedisStore(args.redis_url, namespace=args.namespace, block_when_full=True)
    eng = engine(args, store)
    t0 = time.perf_counter()
    stored = sum(eng.precompute(case.chunks) for case in cases(args, eng.tokenizer))
    store.close()  # waits for the asynchronous writes
    print(
        f"[warm pid {os.getpid()}] stored {stored} chunks in Redis in "
        f"{time.perf_counter() - t0:.1f} s ({store.bytes_written / 2**20:.1f} MiB)"
    )


def query(args: argparse.Namespace) -> None:
    from ragblend.store import MemoryStore
    from ragblend.store.layered import LayeredStore
    from ragblend.store.redis import RedisStore

    eng = engine(
        args, LayeredStore([MemoryStore(), RedisStore(args.redis_url, namespace=args.namespace)])
    )
    for case in cases(args, eng.tokenizer):
        blend = eng.generate(case.question, case.chunks, max_new_tokens=args.max_new_tokens)
        full = eng.generate(
            case.question, case.chunks, mode="full", max_new_tokens=args.max_new_tokens
        )
        s = blend.stats
        print(
            f"[query pid {os.getpid()}] {case.question}\n"
            f"    hits {s.chunk_hits}/{s.chunk_hits + s.chunk_misses}  "
            f"TTFT blend {s.ttft_ms:.0f} ms vs full {full.stats.ttft_ms:.0f} ms\n"
            f"    answer: {blend.text.strip()!r}"
        )
    eng.store.close()


def start_redis(directory: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            directory,
        ],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    sys.exit("redis-server did not start")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "warm":
        warm(args)
        return 0
    if args.role == "query":
        query(args)
        return 0
    if not args.dataset.is_file():
        sys.exit(f"dataset not found: {args.dataset} (pass --dataset)")
    with tempfile.TemporaryDirectory(prefix="ragblend-redis-") as tmp:
        server = None
        if args.redis_url is None:
            server, args.redis_url = start_redis(tmp)
            print(f"started redis-server at {args.redis_url}")
        try:
            base = [
                sys.executable,
                __file__,
                "--dataset",
                str(args.dataset),
                "--questions",
                str(args.questions),
                "--top-k",
                str(args.top_k),
                "--chunk-tokens",
                str(args.chunk_tokens),
                "--model",
                args.model,
                "--redis-url",
                args.redis_url,
                "--namespace",
                args.namespace,
                "--max-new-tokens",
                str(args.max_new_tokens),
            ]
            for role in ("warm", "query"):  # two separate processes, one shared tier
                subprocess.run([*base, "--role", role], check=True)
        finally:
            if server is not None:
                server.kill()
                server.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
