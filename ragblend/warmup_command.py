"""``ragblend warmup``: precompute every chunk of a dataset or a Chroma collection to disk.

Resumable (stored chunks are skipped, so a rerun continues where an interrupted run stopped),
safe to run in several processes on the same store, and interruptible with Ctrl-C (the chunk
being written finishes or is discarded atomically; nothing half-written is ever indexed).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ragblend.errors import RagblendError


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
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="cut each chunk to N tokens (dataset default 512, like the bench; "
                        "Chroma documents are kept whole unless given)")
    p.add_argument("--limit", type=int, default=None, help="dataset: first N questions")
    p.add_argument("--store-path", default=None, help="disk store (default: ragblend_home()/kv)")
    p.add_argument("--store-bytes", type=int, default=None, help="disk store capacity in bytes")
    p.add_argument("--model", default="embedded", help="'embedded' or a local HF model dir")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto", help="auto / float32 / bfloat16 / float16")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def dataset_chunks(path: str | Path, tokenizer, top_k: int, chunk_tokens: int,
                   limit: int | None = None) -> list[str]:
    """Distinct chunk texts of a MuSiQue-format file, cut exactly as ``ragblend bench`` cuts."""
    from ragblend.bench.datasets import load_cases

    cases = load_cases(path, tokenizer, top_k, chunk_tokens, limit)
    return list(dict.fromkeys(c for case in cases for c in case.chunks))


def chroma_documents(path: str | Path, collection: str, batch: int = 256) -> Iterator[str]:
    """Documents of a Chroma collection, read with ``get`` (no embedding function is built)."""
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
        got = col.get(include=["documents"], limit=batch, offset=offset)
        docs = got.get("documents") or []
        if not docs:
            return
        yield from (d for d in docs if d and d.strip())
        offset += len(docs)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def run(args: argparse.Namespace) -> int:
    from ragblend.config import BlendConfig
    from ragblend.engine import BlendEngine
    from ragblend.store.disk import DEFAULT_DISK_BYTES, DiskStore
    from ragblend.warmup import WarmupQueue

    if bool(args.dataset) == bool(args.chroma_path):
        raise RagblendError("give either --dataset or --chroma-path (with --collection)")
    if args.chroma_path and not args.collection:
        raise RagblendError("--chroma-path needs --collection")
    store = DiskStore(args.store_path, args.store_bytes or DEFAULT_DISK_BYTES)
    config = BlendConfig(device=args.device, dtype=args.dtype)
    engine = BlendEngine.from_pretrained(args.model, config=config, store=store)
    tok = engine.tokenizer
    if args.dataset:
        chunks = dataset_chunks(args.dataset, tok, args.top_k, args.chunk_tokens or 512, args.limit)
    else:
        from ragblend.bench.datasets import cut_to_tokens

        chunks = list(dict.fromkeys(chroma_documents(args.chroma_path, args.collection)))
        if args.chunk_tokens:
            chunks = [cut_to_tokens(tok, c, args.chunk_tokens) for c in chunks]

    from tqdm.auto import tqdm

    bar = tqdm(total=len(chunks), unit="chunk", desc="warmup", disable=args.no_progress,
               dynamic_ncols=True)
    disk_full = threading.Event()

    def done(stored: bool) -> None:
        bar.update(1)
        bar.set_postfix_str(f"written {_human(store.bytes_written)}", refresh=False)
        if store.last_write_error == "disk full":
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
        bar.write("interrupted: finishing the chunk in progress (rerun to resume)",
                  file=sys.stderr)
        queue.close(wait=False)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    failed_writes = store.write_errors
    stored = queue.stored - failed_writes
    print(
        f"warmup: {stored} chunks stored, {queue.skipped} already stored, "
        f"{len(queue.errors) + failed_writes} failed, {_human(store.bytes_written)} written "
        f"in {seconds:.1f} s ({(stored + queue.skipped) / max(seconds, 1e-9):.2f} chunks/s)"
    )
    print(f"store {store.path}: {len(store)} entries, {_human(store.nbytes)}")
    if failed_writes:
        print(f"warmup: {failed_writes} chunks could not be written: {store.last_write_error}"
              + (" (stopped early)" if disk_full.is_set() else ""), file=sys.stderr)
    for err in queue.errors[:5]:
        print(f"warmup: error: {err}", file=sys.stderr)
    if interrupted:
        return 130
    return 1 if failed_writes or queue.errors else 0
