"""``ragblend warmup``: datasets and Chroma into the disk store; crash, concurrency, disk full."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_model

from ragblend import BlendConfig, BlendEngine
from ragblend.cli import main
from ragblend.store import DiskStore, MemoryStore
from ragblend.warmup import WarmupQueue

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "river mountain castle author poem novel city king battle college painter music "
    "ocean island treaty engine science winter garden empire"
).split()


def passage(i: int) -> str:
    rng = random.Random(i)
    return f"Passage {i}. " + " ".join(rng.choice(WORDS) for _ in range(24 + i % 7)) + "."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def entries(n_chunks: int) -> int:
    """A warmed store's entries: each chunk's own and its first-chunk entry
    (``exact_first_chunk``), the canonical head's and the prompt head's exact caches."""
    return 2 * n_chunks + 2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, int]:
    """12 questions × 3 ctxs; every third question reuses an earlier passage (dedup)."""
    cases, used = [], set()
    for q in range(12):
        ids = [q * 3, q * 3 + 1, (q - 1) * 3 if q % 3 == 2 else q * 3 + 2]
        used.update(ids)
        cases.append(
            {
                "question": f"Question {q}?",
                "answers": ["x"],
                "ctxs": [{"title": "", "text": passage(i)} for i in ids],
            }
        )
    path = tmp_path_factory.mktemp("data") / "musique.json"
    path.write_text(json.dumps(cases))
    return path, len(used)


def warmup_args(dataset: Path, model_dir: Path, store: Path, *extra: str) -> list[str]:
    return [
        "warmup",
        "--dataset",
        str(dataset),
        "--model",
        str(model_dir),
        "--store-path",
        str(store),
        "--top-k",
        "3",
        "--chunk-tokens",
        "48",
        "--no-progress",
        *extra,
    ]


def check_store(path: Path) -> DiskStore:
    """Every indexed entry reads completely and verifies; the byte count matches the files."""
    store = DiskStore(path, 1 << 40)
    report = store.verify()
    assert report == {"ok": report["ok"], "corrupt": 0, "foreign": 0, "errors": []}
    for key in store.keys():
        entry = store.get(key)
        assert entry is not None
        entry.materialize()
    files = [store.data_dir / store.index.get(k).file for k in store.keys()]
    assert store.nbytes == sum(f.stat().st_size for f in files)
    return store


# ---------------------------------------------------------------------- in process
def test_warmup_stores_every_distinct_chunk_and_resumes_by_skipping(
    dataset, model_dir, tmp_path, capsys
):
    path, n_chunks = dataset
    store_path = tmp_path / "kv"
    assert main(warmup_args(path, model_dir, store_path)) == 0
    out = capsys.readouterr().out
    assert f"{n_chunks} chunks stored, 0 already stored" in out
    store = check_store(store_path)
    assert len(store) == entries(n_chunks)

    assert main(warmup_args(path, model_dir, store_path)) == 0
    assert f"0 chunks stored, {n_chunks} already stored" in capsys.readouterr().out

    # A query over a dataset question finds every chunk, cut exactly as the bench cuts it.
    from ragblend.bench.datasets import load_cases

    engine = BlendEngine.from_pretrained(str(model_dir), store=DiskStore(store_path))
    case = load_cases(path, engine.tokenizer, 3, 48)[4]
    result = engine.generate(case.question, case.chunks, max_new_tokens=2)
    assert result.stats.chunk_hits == 3 and result.stats.chunk_misses == 0


def test_warmup_reads_documents_from_a_chroma_collection(model_dir, tmp_path, capsys):
    chromadb = pytest.importorskip("chromadb")
    client = chromadb.PersistentClient(path=str(tmp_path / "chroma"))
    col = client.create_collection("docs", embedding_function=None)
    docs = [passage(i) for i in range(5)]
    col.add(
        ids=[f"d{i}" for i in range(5)],
        documents=docs,
        embeddings=[[float(i), 1.0, 0.5] for i in range(5)],
    )
    args = [
        "warmup",
        "--chroma-path",
        str(tmp_path / "chroma"),
        "--collection",
        "docs",
        "--model",
        str(model_dir),
        "--store-path",
        str(tmp_path / "kv"),
        "--no-progress",
    ]
    assert main(args) == 0
    assert "5 chunks stored" in capsys.readouterr().out
    engine = BlendEngine.from_pretrained(str(model_dir), store=DiskStore(tmp_path / "kv"))
    assert all(engine.is_cached(d) for d in docs)
    bad = [*args[:4], "nope", *args[5:]]
    assert main(bad) == 2  # a missing collection is a clean error


def test_disk_full_is_reported_and_queries_still_answer(
    dataset, model_dir, tmp_path, monkeypatch, capsys
):
    def full(self, tmp, key, kv):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskStore, "_write", full)
    path, _ = dataset
    assert main(warmup_args(path, model_dir, tmp_path / "kv")) == 1
    captured = capsys.readouterr()
    assert "could not be written: disk full (stopped early)" in captured.err
    assert "0 chunks stored" in captured.out

    store = DiskStore(tmp_path / "kv")
    assert len(store) == 0
    engine = BlendEngine.from_pretrained(str(model_dir), store=store)
    reference = BlendEngine.from_pretrained(str(model_dir), store=MemoryStore())
    question, chunks = "Question 1?", [passage(3), passage(4)]
    got = engine.generate(question, chunks, max_new_tokens=4)
    assert got.stats.chunk_misses == 2
    assert got.token_ids == reference.generate(question, chunks, max_new_tokens=4).token_ids


def test_queue_dedups_ids_and_texts_and_reports_each_item(tokenizer):
    engine = BlendEngine(tiny_model("mistral"), tokenizer, BlendConfig(), MemoryStore())
    done = []
    ids = tokenizer(passage(1), add_special_tokens=False)["input_ids"]
    with WarmupQueue(engine, on_done=done.append) as queue:
        queue.submit_ids([ids, ids], block=True)
        queue.submit([passage(2), passage(2)], block=True)
        queue.join()
        queue.submit_ids([ids])  # stored already: skipped by the worker
        queue.join()
    assert queue.stored == 2 and queue.skipped >= 1
    assert done.count(True) == 2 and len(done) == queue.stored + queue.skipped
    assert engine.is_cached(passage(2))


# ---------------------------------------------------------------------- other processes
CHILD = r"""
import os, signal, sys, time
point, nth = sys.argv[1], int(sys.argv[2])
argv = sys.argv[3:]
calls = {"n": 0}

def due():
    calls["n"] += 1
    return calls["n"] == nth

def die():
    os.kill(os.getpid(), signal.SIGKILL)

from ragblend.store import disk, index

real_write, real_replace, real_add_bytes = (
    disk.DiskStore._write, os.replace, index.DiskIndex._add_bytes)

writes = {"n": 0}

def write(self, tmp, key, kv):
    writes["n"] += 1
    if point in ("random", "sigint"):
        time.sleep(0.05)  # slow enough for the parent to interrupt mid-run
    if point == "sigint" and writes["n"] > 3:
        time.sleep(0.5)  # the parent signals after 3 entries: never let the job outrun it
    size = real_write(self, tmp, key, kv)
    if point == "mid-write" and due():
        os.truncate(tmp, size // 2)  # the process dies with half the file written
        die()
    return size

def replace(src, dst, *a, **k):
    ours = str(src).endswith(".tmp")
    if ours and point == "before-rename" and due():
        die()
    real_replace(src, dst, *a, **k)
    if ours and point == "after-rename" and due():
        die()

def add_bytes(self, con, delta):
    if delta > 0 and point == "mid-index" and due():
        die()  # inside the index transaction: it never commits
    return real_add_bytes(self, con, delta)

disk.DiskStore._write = write
os.replace = replace
index.DiskIndex._add_bytes = add_bytes
from ragblend.cli import main
sys.exit(main(argv))
"""


def spawn(point: str, nth: int, args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, point, str(nth), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def count_entries(path: Path) -> int:
    if not (path / "index").is_dir():
        return 0
    return len(DiskStore(path, 1 << 40))


def interrupt_when(proc: subprocess.Popen, path: Path, entries: int, sig: int) -> None:
    while proc.poll() is None and count_entries(path) < entries:
        time.sleep(0.02)
    if proc.poll() is None:
        proc.send_signal(sig)


def test_kills_at_any_point_leave_only_complete_entries_and_warmup_resumes(
    dataset, model_dir, tmp_path
):
    path, n_chunks = dataset
    sigint_path = tmp_path / "kv-sigint"
    proc = spawn("sigint", 0, warmup_args(path, model_dir, sigint_path))  # Ctrl-C: graceful
    interrupt_when(proc, sigint_path, 3, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode in (130, 0), err
    if proc.returncode == 130:
        assert "interrupted" in err
    check_store(sigint_path)

    # The kill points run on a store of their own, so each one has chunks left to die in.
    store_path = tmp_path / "kv"
    args = warmup_args(path, model_dir, store_path)
    rng = random.Random(7)
    # A kill before the rename leaves the same debris as mid-write (a temp file), so the
    # points cover: temp file half written, data file renamed but not indexed, index
    # transaction open, and wherever a random kill lands.
    for point in ("mid-write", "after-rename", "mid-index", "random"):
        before = count_entries(store_path)
        proc = spawn(point, rng.randint(1, 3), args)
        if point == "random":
            interrupt_when(proc, store_path, before + rng.randint(1, 4), signal.SIGKILL)
        proc.communicate(timeout=120)
        assert proc.returncode in (-signal.SIGKILL, 0), f"{point}: rc {proc.returncode}"
        if point != "random":
            assert proc.returncode == -signal.SIGKILL, point
        check_store(store_path)

    store = DiskStore(store_path)
    debris = store.disk_usage()["tmp"]
    assert debris > 0  # the killed writers left temp files behind, never indexed
    assert main(args) == 0  # resume to completion
    store = check_store(store_path)
    assert len(store) == entries(n_chunks)
    cleaned = store.gc(grace_s=0)
    assert cleaned["stale_tmp"] >= 1 and cleaned["orphans"] >= 2  # mid-write; rename, index
    assert len(list(store.data_dir.glob("*/*.safetensors"))) == len(store)
    check_store(store_path)


def test_two_processes_warming_the_same_chunks_store_each_once(dataset, model_dir, tmp_path):
    path, n_chunks = dataset
    store_path = tmp_path / "kv"
    # the reference below precomputes alone: so do the two processes (no neighbours)
    args = [*warmup_args(path, model_dir, store_path), "--precompute-context", "canonical"]
    procs = [spawn("none", 0, args) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "warmup:" in out
    store = check_store(store_path)
    assert len(store) == entries(n_chunks)
    assert store.counters()["puts"] == entries(n_chunks)  # one indexed write per entry
    assert len(list(store.data_dir.glob("*/*.safetensors"))) == entries(n_chunks)
    assert not list(store.tmp_dir.iterdir())
    engine = BlendEngine.from_pretrained(str(model_dir), store=store)
    ref = BlendEngine.from_pretrained(str(model_dir), store=MemoryStore())
    ref.precompute([passage(0), passage(1)])
    for chunk in (passage(0), passage(1)):
        key = engine.chunk_key(
            context_ids=engine.chunks.context_ids(engine.tokenize("q", [chunk]).head),
            chunk_ids=engine.tokenizer(chunk, add_special_tokens=False)["input_ids"],
        )
        got, want = store.get(key), ref.store.get(key)
        assert all(torch.equal(got.layer(i)[0], want.layer(i)[0]) for i in range(3))
