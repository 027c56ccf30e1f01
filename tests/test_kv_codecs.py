"""Compressed chunk KV (issue 70): group-wise ``int4``/``int2`` and the ``pca<bits>`` transform
coder. Round trips within each code's stated error, entries identical through every tier and
across processes, damaged entries and missing or foreign calibration bases are misses."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis_server as fixtures
import torch
from conftest import CHUNKS, QUESTION, tiny_model

from ragblend import BlendConfig, BlendEngine
from ragblend.errors import CorruptEntryError, RagblendError
from ragblend.store import MemoryStore, groupwise, make_store, pack, transform
from ragblend.store import basis as bases
from ragblend.store.quant import decode_layer

redis_server = fixtures.redis_server
TESTS = Path(__file__).parent


def make_engine(tokenizer, store, kv_dtype: str, seed: int = 0, **config) -> BlendEngine:
    return BlendEngine(
        tiny_model("llama", seed=seed), tokenizer, BlendConfig(kv_dtype=kv_dtype, **config), store
    )


def chunk_kv(engine: BlendEngine, text: str = CHUNKS[0]):
    return engine.chunks.compute_kv(
        engine.tokenizer(text, add_special_tokens=False)["input_ids"], []
    )


@pytest.mark.parametrize("name", ["int4", "int2", "k8v4", "k4v8"])
def test_groupwise_codes_round_trip_within_half_a_step_of_their_group(name):
    torch.manual_seed(0)
    k = torch.randn(2, 3, 150, 16) * torch.linspace(0.1, 8, 16)  # outlier channels
    v = torch.randn(2, 3, 150, 16)
    bits = groupwise.GROUPWISE_BITS[name]
    stored = groupwise.encode(k, v, bits)
    got_k, got_v = groupwise.decode(stored, bits, torch.float32)
    for x, got, scale, lo in (
        (k.transpose(-1, -2), got_k.transpose(-1, -2), stored["k_scale"], stored["k_min"]),
        (v, got_v, stored["v_scale"].transpose(-1, -2), stored["v_min"].transpose(-1, -2)),
    ):
        step = torch.repeat_interleave(scale.transpose(-1, -2).float(), groupwise.GROUP, -1)
        low = torch.repeat_interleave(lo.transpose(-1, -2).float(), groupwise.GROUP, -1)
        n = x.shape[-1]
        bound = step[..., :n] / 2 + low[..., :n].abs() * 2.0**-10 + 1e-6  # fp16 minimum
        assert torch.all((got - x).abs() <= bound)
    # keys: a scale per 64 tokens, so an outlier token moves only its own group's scale
    assert stored["k_scale"].shape == (2, 3, 3, 16)
    assert stored["v_scale"].shape == (2, 3, 150, 1)


def test_transform_codes_are_within_half_a_step_inside_each_components_range():
    torch.manual_seed(0)
    x = torch.randn(2, 300, 16) * torch.logspace(1, -2, 16)
    rotation = torch.eye(16).expand(2, 16, 16).contiguous()  # components are the channels
    coded = transform.encode_tensor(x, rotation, 3.0)
    assert coded["codes"].shape == (1, 300, 2 * 16 * 3 // 8)  # exactly the budget per token
    got = transform.decode_tensor(coded["codes"], coded["stats"], rotation, 3.0)
    mean, std = coded["stats"].float()
    alloc = transform.allocate(std.reshape(-1), transform.budget_bits(3.0, 2, 16)).reshape(2, 16)
    assert int(alloc.sum()) == 2 * 16 * 3 and alloc[:, 0].min() > alloc[:, -1].max()
    step = torch.tensor(transform.STEP)[alloc] * std
    inside = (x - mean[:, None]).abs() < (2.0**alloc / 2 * step)[:, None]
    err = (got - x).abs()
    coded_rows = (alloc > 0)[:, None].expand_as(x)
    assert torch.all(
        err[inside & coded_rows]
        <= (step / 2 * 1.001 + 1e-4)[:, None].expand_as(x)[inside & coded_rows]
    )
    # components with no bits decode to their chunk mean
    assert torch.allclose(
        got[~coded_rows.bool()], mean[:, None].expand_as(x)[~coded_rows], atol=1e-2
    )


def test_more_bits_decode_closer_on_real_chunk_kv(tokenizer):
    engine = make_engine(tokenizer, MemoryStore(), "pca2")
    basis = engine.chunks.load_basis(create=True)
    kv = chunk_kv(engine, " ".join(CHUNKS) * 3)
    errors = []
    for name in ("pca1", "pca2", "pca4", "pca8"):
        entry = pack(kv, name, bases.register(basis))
        k = torch.stack([entry.layer(i)[0] for i in range(kv.num_layers)])
        errors.append(float((k - kv.k).norm() / kv.k.norm()))
    assert errors == sorted(errors, reverse=True) and errors[-1] < 0.02


@pytest.mark.parametrize("kv_dtype", ["int4", "pca2"])
@pytest.mark.parametrize("tier", ["ram", "disk", "tiered", "redis"])
def test_compressed_entries_are_identical_through_every_tier(
    kv_dtype, tier, tokenizer, tmp_path, redis_server
):
    engine = make_engine(tokenizer, MemoryStore(), kv_dtype)
    entry = engine.chunks.pack(chunk_kv(engine))
    store = make_store(tier, path=tmp_path / "kv", fsync=False, url=redis_server.url)
    store.put("key", entry)
    if tier == "tiered":
        store.ram.clear()
    if tier == "redis":
        store.flush()
    got = store.get("key")
    assert got is not None and got.meta["kv_dtype"] == kv_dtype
    for i in range(entry.num_layers):
        want, have = entry.stored_layer(i), got.stored_layer(i)
        assert set(want) == set(have) and all(torch.equal(want[n], have[n]) for n in want)
        assert all(torch.equal(a, b) for a, b in zip(entry.layer(i), got.layer(i)))
    assert got.nbytes == entry.nbytes or tier in ("disk", "tiered")  # files add a header


SUBPROCESS = """
import sys
sys.path.insert(0, {tests!r})
from helpers import tiny_model
from transformers import AutoTokenizer
from ragblend import BlendConfig, BlendEngine
from ragblend.models.loading import embedded_model_dir
from ragblend.store import make_store
engine = BlendEngine(tiny_model("llama"), AutoTokenizer.from_pretrained(embedded_model_dir()),
                     BlendConfig(kv_dtype="pca2"), make_store("disk", path={path!r}, fsync=False))
engine.precompute({chunks!r})
"""


def test_another_process_reads_the_entries_and_basis_it_did_not_write(tokenizer, tmp_path):
    script = SUBPROCESS.format(tests=str(TESTS), path=str(tmp_path), chunks=CHUNKS)
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True, timeout=600)
    here = make_engine(tokenizer, make_store("disk", path=tmp_path, fsync=False), "pca2")
    prompt = here.tokenize(QUESTION, CHUNKS)
    read = here.prefill(prompt, mode="reuse")
    assert read.stats.chunk_hits == len(CHUNKS)
    own = make_engine(tokenizer, MemoryStore(), "pca2")
    own.precompute(CHUNKS)
    assert own.chunks.load_basis().id == here.chunks.load_basis().id  # calibration is repeatable
    assert torch.equal(own.prefill(prompt, mode="reuse").logits, read.logits)


@pytest.mark.parametrize("kv_dtype", ["int4", "pca2"])
def test_a_corrupted_or_truncated_compressed_entry_is_a_miss_that_is_recomputed(
    kv_dtype, tokenizer, tmp_path
):
    store = make_store("disk", path=tmp_path, fsync=False)
    engine = make_engine(tokenizer, store, kv_dtype)
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    clean = engine.prefill(prompt, mode="blend")
    key = engine.chunk_key(
        context_ids=engine.chunks.context_ids(prompt.head), chunk_ids=prompt.chunks[1]
    )
    path = store.data_dir / store._entry(key)["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit of the codes
    path.write_bytes(bytes(data))
    damaged = engine.prefill(prompt, mode="blend")
    assert damaged.stats.chunk_misses == 1 and key not in store
    engine.precompute(CHUNKS)
    path = store.data_dir / store._entry(key)["file"]
    path.write_bytes(path.read_bytes()[:-100])  # truncated
    assert engine.prefill(prompt, mode="blend").stats.chunk_misses == 1
    engine.precompute(CHUNKS)
    again = engine.prefill(prompt, mode="blend")
    assert again.stats.chunk_misses == 0 and torch.equal(again.logits, clean.logits)


def test_the_basis_is_kept_under_the_models_fingerprint(tokenizer):
    store = MemoryStore()
    one = make_engine(tokenizer, store, "pca2")
    other = make_engine(tokenizer, store, "pca2", seed=1)
    one.precompute(CHUNKS[:1])
    assert one.chunks.basis_key in store and other.chunks.basis_key not in store
    assert other.chunks.load_basis() is None  # another model never reads it
    prompt = other.tokenize(QUESTION, CHUNKS[:1])
    assert other.prefill(prompt, mode="blend").stats.chunk_misses == 1
    other.precompute(CHUNKS[:1])
    assert other.chunks.load_basis().id != one.chunks.load_basis().id


def test_a_missing_basis_makes_every_coded_entry_a_miss(tokenizer):
    store = MemoryStore()
    engine = make_engine(tokenizer, store, "pca2")
    engine.precompute(CHUNKS)
    store.discard(engine.chunks.basis_key)
    fresh = make_engine(tokenizer, store, "pca2")
    prompt = fresh.tokenize(QUESTION, CHUNKS)
    assert fresh.prefill(prompt, mode="blend").stats.chunk_misses == len(CHUNKS)


def test_a_foreign_or_damaged_basis_is_never_used_to_decode(tokenizer):
    store = MemoryStore()
    engine = make_engine(tokenizer, store, "pca2")
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    right = engine.chunks.load_basis()
    # another basis stored in its place (a lost race, another calibration): keys name the basis
    torch.manual_seed(3)
    q = torch.linalg.qr(torch.randn(*right.k.shape))[0].contiguous()
    foreign = transform.Basis(k=q, v=q)
    store.put(engine.chunks.basis_key, bases.as_entry(foreign, {}))
    fresh = make_engine(tokenizer, store, "pca2")
    assert fresh.chunks.load_basis().id == foreign.id
    assert fresh.prefill(prompt, mode="blend").stats.chunk_misses == len(CHUNKS)
    # a basis whose tensors do not match the id it names is dropped
    damaged = bases.as_entry(right, {})
    damaged.meta["basis"] = foreign.id
    store.put(engine.chunks.basis_key, damaged)
    assert make_engine(tokenizer, store, "pca2").chunks.load_basis() is None
    assert engine.chunks.basis_key not in store
    # an entry whose basis is not loaded here does not decode
    entry = engine.chunks.pack(chunk_kv(engine))
    meta = {**entry.meta, "basis": "0" * 16}
    with pytest.raises(CorruptEntryError):
        decode_layer(meta, entry.stored_layer(0), 0)


@pytest.mark.parametrize("kv_dtype", ["int4", "pca2"])
def test_ratio_one_is_full_prefill_from_compressed_entries(kv_dtype, tokenizer):
    engine = make_engine(tokenizer, MemoryStore(), kv_dtype, ratio=1.0)
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    fused = engine.prefill(prompt, mode="blend")
    full = engine.prefill(prompt, mode="full")
    assert fused.stats.chunk_hits == len(CHUNKS)
    assert torch.allclose(fused.logits, full.logits, atol=1e-4, rtol=1e-4)


def test_codec_names_are_checked_by_config_and_every_cli():
    from ragblend.cli import build_parser

    assert BlendConfig(kv_dtype="pca1.5").kv_dtype == "pca1.5"
    for bad in ("pca9", "pca0", "int3", "pca"):
        with pytest.raises(RagblendError, match="kv_dtype"):
            BlendConfig(kv_dtype=bad)
    parser = build_parser()
    for command in (
        ["bench", "--dataset", "x", "--out", "y"],
        ["warmup", "--dataset", "x"],
        ["serve"],
    ):
        assert parser.parse_args([*command, "--kv-dtype", "pca2"]).kv_dtype == "pca2"
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--kv-dtype", "int3"])


@pytest.mark.parametrize("kv_dtype", ["float32", "int8", "pca2"])
def test_cache_plan_reports_measured_bytes_warmup_and_every_tier(kv_dtype, tmp_path, capsys):
    import json

    from ragblend.cli import main
    from ragblend.store.quant import kv_bytes_per_token

    argv = ["cache", "plan", "--model", "tiny", "--chunks", "1000", "--chunk-tokens", "64"]
    argv += ["--kv-dtype", kv_dtype, "--store-path", str(tmp_path), "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)
    # the shape's 4 layers, measured on 2 and scaled; chunks after the prompt head: one entry
    assert plan["entries_per_chunk"] == 1 and plan["measured_layers"].startswith("2 of")
    formula = kv_bytes_per_token(kv_dtype, 4, 2, 16, 64) * 64
    assert plan["bytes_per_chunk"] == pytest.approx(formula)
    assert plan["corpus_bytes"] == pytest.approx(1000 * plan["bytes_per_chunk"])
    assert plan["warmup_chunks_per_s"] > 0
    assert set(plan["tiers"]) == {"ram", "disk"}
    for tier in plan["tiers"].values():
        assert tier["hidden"] == (tier["load_ms"] <= tier["recompute_ms"])
        assert tier["load_ms"] > 0 and tier["recompute_ms"] > 0


def test_cache_plan_refuses_an_empty_corpus():
    from ragblend.cli import main

    assert main(["cache", "plan", "--model", "tiny", "--chunks", "0"]) == 2


def test_the_transform_coder_works_on_the_shared_redis_tier(tokenizer, redis_server):
    store = make_store("redis", url=redis_server.url)
    writer = make_engine(tokenizer, store, "pca2")
    writer.precompute(CHUNKS)
    reader = make_engine(tokenizer, make_store("redis", url=redis_server.url), "pca2")
    prompt = reader.tokenize(QUESTION, CHUNKS)
    assert reader.prefill(prompt, mode="blend").stats.chunk_hits == len(CHUNKS)


def test_a_store_too_small_for_the_basis_leaves_it_to_the_engine(tokenizer):
    store = MemoryStore(1 << 10)  # keeps nothing: every entry is larger
    engine = make_engine(tokenizer, store, "pca2")
    engine.precompute(CHUNKS)
    assert engine.chunks.load_basis() is not None and engine.chunks.basis_key not in store
    other = make_engine(tokenizer, store, "pca2")
    prompt = other.tokenize(QUESTION, CHUNKS)
    assert other.prefill(prompt, mode="blend").stats.chunk_misses == len(CHUNKS)
