"""The disk tier against diskcache's ``Cache`` holding the same chunk KV, read as blend reads it.

    pip install diskcache   # not a ragblend dependency
    python benchmarks/store/diskcache_compare.py \\
        --out benchmarks/results/amd-avx2/diskcache_compare.json

Six chunks of SmolLM2-135M's KV shape (30 layers, 3 KV heads, 512 tokens, head dim 64, fp32;
random values: only the bytes matter) are stored in a ``DiskStore`` and, as one safetensors
blob per chunk (no pickle), in a ``diskcache.Cache``. The fusor needs layer 0 of every chunk
first and layer i+1 while layer i computes, so each read is timed twice: until layer 0 of all
six chunks is in memory, and until every layer is. Cold reads drop the files from the page
cache first; warm reads do not. Stores are read in turn, ``--repeats`` times, medians kept.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ragblend import cpu
from ragblend.store import files
from ragblend.store.base import ChunkKV
from ragblend.store.disk import DiskStore

SHAPE = (30, 3, 512, 64)  # layers, KV heads, tokens, head dim


def read_disk(store: DiskStore, keys: list[str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    entries = [store.get(k) for k in keys]
    firsts = [e.layer(0) for e in entries if e is not None]
    first = time.perf_counter() - t0
    for e in entries:
        assert e is not None
        for i in range(1, e.num_layers):
            e.layer(i)
    assert len(firsts) == len(keys)
    return first, time.perf_counter() - t0


def read_diskcache(cache, keys: list[str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    tensors = [load_tensors(cache.get(k)) for k in keys]  # a value is read whole: every layer
    assert all(t["k"].shape == SHAPE for t in tensors)  # arrives before layer 0 can be used
    elapsed = time.perf_counter() - t0
    return elapsed, elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import diskcache  # the peer, not a ragblend dependency: --help runs without it

    root = Path(tempfile.mkdtemp(prefix="ragblend-diskcache-compare-"))
    store = DiskStore(root / "tier", fsync=False)
    cache = diskcache.Cache(str(root / "diskcache"))
    keys = [f"chunk{i}" for i in range(args.chunks)]
    for key in keys:
        kv = ChunkKV(torch.randn(SHAPE), torch.randn(SHAPE), {"dtype": "float32"})
        store.put(key, kv)
        cache.set(key, save_tensors({"k": kv.k.contiguous(), "v": kv.v.contiguous()}))
    cache_files = [p for p in (root / "diskcache").rglob("*") if p.is_file()]
    readers = {
        "disk_tier": (lambda: read_disk(store, keys), store.drop_page_cache),
        "diskcache": (
            lambda: read_diskcache(cache, keys),
            lambda: files.drop_page_cache(cache_files),
        ),
    }
    times: dict[str, dict[str, list[float]]] = {
        f"{name}_{temp}_{what}": {"ms": []}
        for name in readers
        for temp in ("cold", "warm")
        for what in ("layer0", "all")
    }
    for _ in range(args.repeats):
        for temp in ("cold", "warm"):
            for name, (read, drop) in readers.items():
                if temp == "cold":
                    drop()
                else:
                    read()
                first, total = read()
                times[f"{name}_{temp}_layer0"]["ms"].append(first * 1e3)
                times[f"{name}_{temp}_all"]["ms"].append(total * 1e3)
    result = {
        "settings": {
            "chunks": args.chunks,
            "shape": SHAPE,
            "dtype": "float32",
            "bytes_per_chunk": 2 * 4 * int(torch.tensor(SHAPE).prod()),
            "repeats": args.repeats,
            "diskcache": diskcache.__version__,
            **cpu.describe(),
        },
        "median_ms": {k: round(statistics.median(v["ms"]), 2) for k, v in times.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result["median_ms"], indent=2))


if __name__ == "__main__":
    main()
