"""Storage dtypes of chunk KV (``BlendConfig.kv_dtype``): round trips within stated bounds
through every tier, int8 entries never serve another storage dtype, damaged scales are misses."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model

from ragblend import BlendConfig, BlendEngine
from ragblend.errors import CorruptEntryError, RagblendError
from ragblend.store import MemoryStore, QuantizedKV, make_store, pack
from ragblend.store.quant import stored_bytes_per_token

DTYPES = ("float32", "bfloat16", "float16", "int8")


def make_engine(tokenizer, store, family="llama", kv_dtype="auto") -> BlendEngine:
    config = BlendConfig(kv_dtype=kv_dtype)
    return BlendEngine(tiny_model(family), tokenizer, config, store)


def error_bound(kv_dtype: str, x: torch.Tensor, per: int) -> torch.Tensor:
    """The largest error allowed per element of ``x`` [layers, heads, tokens, dim] stored in
    ``kv_dtype``: half an int8 step of the slice's scale (``per``: the reduced dimension), or
    half an ulp of the float format (relative), plus float32 rounding."""
    if kv_dtype == "int8":
        step = x.abs().amax(dim=per, keepdim=True) / 127
        return step / 2 * (1 + 1e-5) + 1e-7
    eps = {"float32": 0.0, "bfloat16": 2.0**-8, "float16": 2.0**-11}[kv_dtype]
    return x.abs() * eps + (6e-8 if kv_dtype == "float16" else 0.0)


@pytest.mark.parametrize("tier", ["ram", "disk", "tiered"])
@pytest.mark.parametrize("kv_dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_storage_dtype_round_trips_within_its_bound_through_every_tier(
    family, kv_dtype, tier, tokenizer, tmp_path
):
    engine = make_engine(tokenizer, MemoryStore(), family)
    ids = tokenizer(CHUNKS[0], add_special_tokens=False)["input_ids"]
    kv = engine.chunks.compute_kv(ids, [])
    store = make_store(tier, path=tmp_path / "kv", fsync=False)
    store.put("key", pack(kv, kv_dtype))
    if tier == "tiered":
        store.ram.clear()  # read through the disk tier (and promote)
    got = store.get("key")
    assert got is not None and got.meta["kv_dtype"] == kv_dtype
    bound_k, bound_v = error_bound(kv_dtype, kv.k, -2), error_bound(kv_dtype, kv.v, -1)
    for i in range(kv.num_layers):
        k, v = got.layer(i)
        assert k.dtype == v.dtype == torch.float32  # decoded to the compute dtype
        assert torch.all((k - kv.k[i]).abs() <= bound_k[i])
        assert torch.all((v - kv.v[i]).abs() <= bound_v[i])
    if tier == "tiered":
        assert store.get("key").meta["kv_dtype"] == kv_dtype  # promoted as stored


def test_int8_stores_about_a_quarter_of_float32_with_its_scales(tokenizer):
    engine = make_engine(tokenizer, MemoryStore())
    kv = engine.chunks.compute_kv(tokenizer(CHUNKS[0], add_special_tokens=False)["input_ids"], [])
    q = pack(kv, "int8")
    assert isinstance(q, QuantizedKV)
    layers, heads, tokens, dim = kv.k.shape
    scales = layers * heads * (dim + tokens) * 4  # per-channel K, per-token V, float32
    assert q.nbytes == kv.nbytes // 4 + scales
    assert stored_bytes_per_token(q) == pytest.approx(q.nbytes / tokens)
    assert set(q.stored_layer(0)) == {"k", "k_scale", "v", "v_scale"}


def test_an_int8_entry_is_a_miss_for_a_request_expecting_another_storage_dtype(tokenizer, tmp_path):
    store = make_store("disk", path=tmp_path, fsync=False)
    int8 = make_engine(tokenizer, store, kv_dtype="int8")
    int8.precompute(CHUNKS)
    prompt = int8.tokenize(QUESTION, CHUNKS)
    assert int8.prefill(prompt, mode="blend").stats.chunk_hits == len(CHUNKS)
    for other in ("bfloat16", "float32"):
        engine = make_engine(tokenizer, store, kv_dtype=other)
        assert engine.prefill(prompt, mode="blend").stats.chunk_misses == len(CHUNKS)


def test_int8_ram_entries_are_decoded_on_the_loaders_reader_thread(tokenizer):
    store = MemoryStore()
    engine = make_engine(tokenizer, store, kv_dtype="int8")
    assert store.prefetch_depth == 0
    engine.precompute(CHUNKS)
    assert store.prefetch_depth > 0  # the layer loader reads ahead (and decodes) on a thread


def _flip_scale_byte(store, key: str, name: str) -> None:
    path = store.data_dir / store._entry(key)["file"]
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        begin, _ = header[name]["data_offsets"]
        f.seek(8 + n + begin + 2)
        byte = f.read(1)
        f.seek(8 + n + begin + 2)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("scale", ["k_scale.1", "v_scale.2"])
def test_a_corrupted_scale_tensor_on_disk_is_caught_by_the_checksum(scale, tokenizer, tmp_path):
    store = make_store("disk", path=tmp_path, fsync=False)
    engine = make_engine(tokenizer, store, kv_dtype="int8")
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    key = engine.chunk_key(
        context_ids=engine.chunks.context_ids(prompt.head), chunk_ids=prompt.chunks[1]
    )
    _flip_scale_byte(store, key, scale)
    layer = int(scale.rsplit(".", 1)[1])
    entry = store.get(key)
    with pytest.raises(CorruptEntryError):
        entry.layer(layer)
    assert key not in store  # dropped
    engine.precompute(CHUNKS)  # stored again, intact
    _flip_scale_byte(store, key, scale)
    damaged = engine.prefill(prompt, mode="blend")
    assert damaged.stats.chunk_misses == 1  # a miss, not a wrong answer
    clean = engine.prefill(prompt, mode="blend")
    assert clean.stats.chunk_misses == 1
    assert torch.equal(damaged.logits, clean.logits)


def test_an_unknown_storage_dtype_is_refused_by_name(tokenizer):
    engine = make_engine(tokenizer, MemoryStore())
    kv = engine.chunks.compute_kv([1, 2, 3], [])
    with pytest.raises(RagblendError, match="int3"):
        pack(kv, "int3")


def test_cache_stats_show_bytes_per_token_per_storage_dtype(tokenizer, tmp_path, capsys):
    from ragblend.cli import main

    store = make_store("disk", path=tmp_path, fsync=False)
    for kv_dtype in ("float32", "int8"):
        make_engine(tokenizer, store, kv_dtype=kv_dtype).precompute(CHUNKS[:1])
    assert main(["cache", "stats", "--store-path", str(tmp_path), "--json"]) == 0
    per = json.loads(capsys.readouterr().out)["kv_dtypes"]
    assert per["int8"]["entries"] == 2  # the chunk's own entry and its first-chunk entry
    # tiny model: the file header is a large share of each entry here
    assert per["int8"]["bytes_per_token"] < per["float32"]["bytes_per_token"] / 2
    assert main(["cache", "stats", "--store-path", str(tmp_path)]) == 0
    assert "B/token" in capsys.readouterr().out
    assert os.path.isdir(tmp_path / "index")
