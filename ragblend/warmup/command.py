"""``ragblend warmup``: precompute every chunk of a dataset or a Chroma collection into the store.

The store is the local disk tier, or the shared Redis/Valkey tier with ``--redis-url``; with
``--ray [ADDRESS]`` the chunks are precomputed by a pool of Ray actors writing into Redis.

Resumable (stored chunks are skipped, so a rerun continues where an interrupted run stopped),
safe to run in several processes on the same store, and interruptible with Ctrl-C (the chunk
being written finishes or is discarded atomically; nothing half-written is ever indexed).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ragblend.config import kv_dtype_argument
from ragblend.errors import RagblendError
from ragblend.store.cli import StoreFlags, add_store_arguments, open_store


def add_parser(sub) -> None:
    p = sub.add_parser(
        "warmup",
        help="precompute chunk KV caches into the disk store",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_argument_group("source (one of)")
    src.add_argument("--dataset", help="MuSiQue-format JSON list of {question, answers, ctxs}")
    src.add_argument("--chroma-path", help="Chroma persistent directory")
    src.add_argument("--collection", help="Chroma collection name (with --chroma-path)")
    p.add_argument("--top-k", type=int, default=6, help="dataset: chunks per question (first k)")
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help="cut each chunk to N tokens (dataset default 512, like the bench; "
        "Chroma documents are kept whole unless given)",
    )
    p.add_argument("--limit", type=int, default=None, help="dataset: first N questions")
    p.add_argument(
        "--model",
        default="embedded",
        help="'embedded', 'gemma', a .gguf file or a local HF model dir",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto / float32 / bfloat16 / float16")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--kv-dtype",
        type=kv_dtype_argument,
        default=None,
        metavar="D",
        help="storage dtype or codec of chunk KV: auto (default), float32, bfloat16, float16, "
        "int8, int4, int2 or pca<bits> (e.g. pca2); the server must name the same",
    )
    p.add_argument(
        "--precompute-context",
        choices=("canonical", "neighbours", "previous"),
        default=None,
        help="neighbours (default; canonical with --ray): each chunk after its most similar "
        "chunks of the source (the Chroma collection's embeddings; a dataset's passages "
        "embedded with MiniLM); previous: after the passage before it in its case (--dataset); "
        "canonical: alone",
    )
    p.add_argument(
        "--precompute-neighbours", type=int, default=2, help="neighbours per chunk (neighbours)"
    )
    p.add_argument(
        "--exact-first-chunk",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also store each chunk as the first chunk of a prompt in ragblend's default format "
        "sees it (taken exactly by such prompts; a server's own templates do not hit it; "
        "default: on, the engine's default)",
    )
    add_store_arguments(
        p,
        redis_help="write into the shared Redis/Valkey tier (redis://, rediss:// or unix:// URL)",
        store_bytes=True,
    )
    ray = p.add_argument_group("Ray (distributed precompute into --redis-url)")
    ray.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run on Ray: a cluster address ('auto', 'ray://host:10001') or none "
        "for a local instance",
    )
    ray.add_argument("--ray-actors", type=int, default=2, help="actors (model copies)")
    ray.add_argument("--batch-size", type=int, default=8, help="chunks per actor task")
    ray.add_argument("--threads-per-actor", type=int, default=1, help="CPU threads per actor")
    p.set_defaults(func=run)


def dataset_chunks(
    path: str | Path, tokenizer, top_k: int, chunk_tokens: int, limit: int | None = None
) -> list[str]:
    """Distinct chunk texts of a MuSiQue-format file, cut exactly as ``ragblend bench`` cuts."""
    from ragblend.bench.datasets import load_cases

    cases = load_cases(path, tokenizer, top_k, chunk_tokens, limit)
    return list(dict.fromkeys(c for case in cases for c in case.chunks))


def chroma_documents(
    path: str | Path, collection: str, batch: int = 256, embeddings: bool = False
) -> Iterator:
    """Documents of a Chroma collection, read with ``get`` (no embedding function is built);
    ``embeddings``: (document, its stored embedding) pairs."""
    try:
        import chromadb
    except ImportError:
        raise RagblendError("--chroma-path needs chromadb: pip install chromadb") from None
    if not Path(path).is_dir():
        raise RagblendError(f"no Chroma directory at {path}")
    client = chromadb.PersistentClient(path=str(path))
    try:
        col = client.get_collection(collection, embedding_function=None)
    except Exception as exc:  # chromadb raises its own NotFoundError / ValueError
        raise RagblendError(f"cannot open Chroma collection {collection!r}: {exc}") from None
    offset = 0
    while True:
        include: Any = ["documents", "embeddings"] if embeddings else ["documents"]
        got = col.get(include=include, limit=batch, offset=offset)
        docs = got.get("documents") or []
        if not docs:
            return
        if embeddings:
            vectors: Any = got["embeddings"]
            yield from ((d, list(e)) for d, e in zip(docs, vectors) if d and d.strip())
        else:
            yield from (d for d in docs if d and d.strip())
        offset += len(docs)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def run(args: argparse.Namespace) -> int:
    from ragblend.config import NEIGHBOUR_CONTEXTS, BlendConfig
    from ragblend.engine import BlendEngine

    if bool(args.dataset) == bool(args.chroma_path):
        raise RagblendError("give either --dataset or --chroma-path (with --collection)")
    if args.chroma_path and not args.collection:
        raise RagblendError("--chroma-path needs --collection")
    if args.ray and not args.redis_url:
        raise RagblendError("--ray writes into the shared tier: give --redis-url too")
    config = {"device": args.device, "dtype": args.dtype}
    if args.kv_dtype:
        config["kv_dtype"] = args.kv_dtype
    if args.namespace:
        config["namespace"] = args.namespace
    # Ray actors get no neighbour source: by default they precompute chunks alone
    kind = args.precompute_context or (
        "canonical" if args.ray else BlendConfig().precompute_context
    )
    if kind in NEIGHBOUR_CONTEXTS:
        if args.ray:
            raise RagblendError("--precompute-context neighbours/previous runs without --ray")
        if kind == "previous" and not args.dataset:
            raise RagblendError("--precompute-context previous needs --dataset (document order)")
    config["precompute_context"] = kind
    config["precompute_neighbours"] = args.precompute_neighbours
    if args.exact_first_chunk is not None:
        config["exact_first_chunk"] = args.exact_first_chunk
    if args.ray:  # the driver only needs the tokenizer; actors load the model
        from transformers import AutoTokenizer

        from ragblend.models.loading import model_dir

        tokenizer = AutoTokenizer.from_pretrained(model_dir(args.model))
        return _run_ray(args, _chunks(args, tokenizer), config)
    store = open_store(StoreFlags.of(args), require_redis=True, block_when_full=True)
    engine = BlendEngine.from_pretrained(args.model, config=BlendConfig(**config), store=store)
    if kind in NEIGHBOUR_CONTEXTS:
        engine = _with_neighbours(args, engine)
    return _run_local(args, engine, store, _chunks(args, engine.tokenizer))


def _with_neighbours(args: argparse.Namespace, engine):
    """The engine with the run's neighbour source: the dataset's passages, or the Chroma
    collection's documents with their stored embeddings (cut as the warmed chunks are)."""
    if args.dataset:
        from ragblend.bench.neighbours import with_dataset_neighbours

        explicit = args.precompute_context is not None
        return with_dataset_neighbours(engine, args.dataset, args.chunk_tokens or 512, explicit)
    from ragblend.bench.datasets import cut_to_tokens
    from ragblend.neighbours import NeighbourIndex

    texts, vectors = [], []
    for text, vector in chroma_documents(args.chroma_path, args.collection, embeddings=True):
        texts.append(
            cut_to_tokens(engine.tokenizer, text, args.chunk_tokens) if args.chunk_tokens else text
        )
        vectors.append(vector)
    index = NeighbourIndex()
    if texts:
        index.add(texts, vectors, engine.config.namespace)
    return engine.with_config(neighbours=index)


def _chunks(args: argparse.Namespace, tok) -> list[str]:
    if args.dataset:
        return dataset_chunks(args.dataset, tok, args.top_k, args.chunk_tokens or 512, args.limit)
    from ragblend.bench.datasets import cut_to_tokens

    chunks = list(dict.fromkeys(chroma_documents(args.chroma_path, args.collection)))
    if args.chunk_tokens:
        chunks = [cut_to_tokens(tok, c, args.chunk_tokens) for c in chunks]
    return chunks


def _run_local(args: argparse.Namespace, engine, store, chunks: list[str]) -> int:
    from tqdm.auto import tqdm

    from ragblend.store.disk import DiskStore
    from ragblend.warmup import WarmupQueue

    on_disk = isinstance(store, DiskStore)
    bar = tqdm(
        total=len(chunks), unit="chunk", desc="warmup", disable=args.no_progress, dynamic_ncols=True
    )
    disk_full = threading.Event()

    def done(stored: bool) -> None:
        bar.update(1)
        bar.set_postfix_str(f"written {_human(store.bytes_written)}", refresh=False)
        if on_disk and store.last_write_error == "disk full":
            disk_full.set()

    t0 = time.perf_counter()
    interrupted = False
    queue = WarmupQueue(engine, workers=1, max_pending=8, on_done=done)
    try:
        for text in chunks:
            if disk_full.is_set():
                break
            queue.submit([text], block=True)
        queue.join()
        queue.close()
    except KeyboardInterrupt:
        interrupted = True
        bar.write("interrupted: finishing the chunk in progress (rerun to resume)", file=sys.stderr)
        queue.close(wait=False)
    finally:
        bar.close()
    if not on_disk:
        store.flush()  # Redis writes are asynchronous: count them once they have landed
    seconds = time.perf_counter() - t0
    failed_writes = store.write_errors
    stored = queue.stored - failed_writes
    print(
        f"warmup: {stored} chunks stored, {queue.skipped} already stored, "
        f"{len(queue.errors) + failed_writes} failed, {_human(store.bytes_written)} written "
        f"in {seconds:.1f} s ({(stored + queue.skipped) / max(seconds, 1e-9):.2f} chunks/s)"
    )
    if on_disk:
        print(f"store {store.path}: {len(store)} entries, {_human(store.nbytes)}")
        last_error = store.last_write_error
    else:
        print(f"store {store!r}")
        last_error = store.last_error
        store.close()
    if failed_writes:
        print(
            f"warmup: {failed_writes} chunks could not be written: {last_error}"
            + (" (stopped early)" if disk_full.is_set() else ""),
            file=sys.stderr,
        )
    for err in queue.errors[:5]:
        print(f"warmup: error: {err}", file=sys.stderr)
    if interrupted:
        return 130
    return 1 if failed_writes or queue.errors else 0


def _run_ray(args: argparse.Namespace, chunks: Sequence[str], config: dict) -> int:
    """The ``ragblend warmup --ray`` command on a Ray cluster: progress bar and summary line."""
    from tqdm.auto import tqdm

    from ragblend.warmup.ray_actors import warm_on_ray

    bar = tqdm(
        total=len(chunks),
        unit="chunk",
        desc="warmup (ray)",
        disable=args.no_progress,
        dynamic_ncols=True,
    )
    try:
        report = warm_on_ray(
            chunks,
            model=str(args.model),
            redis_url=args.redis_url,
            namespace=args.namespace,
            config=config,
            address=None if args.ray == "local" else args.ray,
            actors=args.ray_actors,
            batch_size=args.batch_size,
            threads_per_actor=args.threads_per_actor,
            on_batch=bar.update,
        )
    finally:
        bar.close()
    print(
        f"warmup: {report.stored} chunks stored, {report.skipped} already stored, "
        f"{report.failed} failed, {_human(report.bytes_written)} written in "
        f"{report.seconds:.1f} s ({report.chunks_per_s:.2f} chunks/s) "
        f"on {args.ray_actors} Ray actors"
    )
    for err in report.errors[:5]:
        print(f"warmup: error: {err}", file=sys.stderr)
    return 1 if report.failed else 0
