"""The native selected-row attention kernel: each row attends exactly keys 0..its position.

Oracle: the per-row reference in fp32 on the same bf16 inputs. The kernel rounds the
probabilities to bf16 before P @ V (as SDPA's CPU flash kernel does), so the gate is relative:
its error against the reference is at most SLACK × the SDPA blocks' error, plus FLOOR.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import engine_for
from test_fusion_mask_and_selection import _reference_rows

from ragblend import BlendConfig
from ragblend.errors import RagblendError
from ragblend.fusion.attention import RowAttentionPlan, attend_rows
from ragblend.kernels.cpu import native

SLACK = 1.5
FLOOR = 2e-3

needs_bf16_level = pytest.mark.skipif(
    not native.cpu_runs_kernel(torch.bfloat16),
    reason="the native bf16 kernels run on CPUs at the avx512_bf16 level or above",
)


def _inputs(n, rows, heads, kv_heads, dim, seed=0):
    torch.manual_seed(seed)
    positions = torch.tensor(sorted(torch.randperm(n)[:rows].tolist()))
    # q as the fusor makes it: a transposed view of [1, m, H, d]
    q = torch.randn(1, rows, heads, dim).transpose(1, 2).bfloat16()
    k = torch.randn(1, kv_heads, n, dim).bfloat16()
    v = torch.randn(1, kv_heads, n, dim).bfloat16()
    return q, k, v, positions


@needs_bf16_level
@pytest.mark.parametrize(
    ("n", "rows", "heads", "kv_heads", "dim"),
    [
        (1300, 200, 9, 3, 64),  # SmolLM2's shape: 3 query heads per KV head, 3 key blocks
        (700, 301, 4, 4, 32),  # no GQA, a partial last tile
        (257, 40, 8, 2, 128),
        (90, 90, 4, 2, 64),  # every row: the causal case
        (600, 1, 2, 1, 64),  # one row
    ],
)
def test_kernel_matches_the_per_row_reference_as_closely_as_sdpa_blocks(
    n, rows, heads, kv_heads, dim
):
    q, k, v, positions = _inputs(n, rows, heads, kv_heads, dim)
    kernel = native.build_kernels().attend_rows
    ref = _reference_rows(q.float(), k.float(), v.float(), positions, 0.125)
    got = kernel(q, k, v, positions, 0.125)
    assert got.shape == (1, rows, heads * dim) and got.dtype == torch.bfloat16
    plan = RowAttentionPlan(positions, heads // kv_heads, q.dtype, None)
    sdpa = attend_rows(q, k, v, plan, 0.125)
    error = float((got.float() - ref).abs().max())
    sdpa_error = float((sdpa.float() - ref).abs().max())
    assert error <= SLACK * sdpa_error + FLOOR, (error, sdpa_error)


@needs_bf16_level
def test_a_row_never_sees_a_later_key():
    q, k, v, positions = _inputs(800, 50, 4, 2, 64, seed=1)
    kernel = native.build_kernels().attend_rows
    before = kernel(q, k, v, positions, 0.125)
    k2, v2 = k.clone(), v.clone()
    last = int(positions[-1])
    k2[:, :, last + 1 :] = 1e3  # huge keys and values after the last row: must not leak
    v2[:, :, last + 1 :] = 1e3
    middle = int(positions[25])
    k2[:, :, middle + 1 : last] = -7.0  # visible only to the rows after `middle`
    after = kernel(q, k2, v2, positions, 0.125)
    assert torch.equal(after[:, :26], before[:, :26])
    assert not torch.equal(after[:, 26:], before[:, 26:])


@needs_bf16_level
def test_bad_positions_are_one_clear_error():
    q, k, v, positions = _inputs(100, 10, 4, 2, 64)
    kernel = native.build_kernels().attend_rows
    with pytest.raises(RuntimeError, match="ascending"):
        kernel(q, k, v, positions.flip(0).contiguous(), 0.125)
    with pytest.raises(RuntimeError, match="outside 100 keys"):
        kernel(q, k, v, positions + 100, 0.125)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel(q.float(), k.float(), v.float(), positions, 0.125)


@needs_bf16_level
@pytest.mark.parametrize("family", FAMILIES)
def test_blend_with_the_kernel_selects_the_same_rows_and_matches_sdpa_blocks(family, tokenizer):
    model = tiny_model(family, dtype=torch.bfloat16, hidden_size=128, head_dim=32)
    engine = engine_for(model, tokenizer, ratio=0.3, check_layers=(1,), check_scales=None)
    assert engine.row_attention == "native"
    sdpa = engine.with_config(row_attention="sdpa")
    assert sdpa.row_attention == "sdpa"
    calls, rotations = [], []
    kernel, rope_ = engine.native.attend_rows, engine.native.rope_
    engine.native = engine.native._replace(
        attend_rows=lambda *a: calls.append(1) or kernel(*a),
        rope_=lambda *a: rotations.append(1) or rope_(*a),
    )
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    got = engine.prefill(prompt, "blend")
    want = sdpa.prefill(prompt, "blend")
    # every layer runs the kernel (those before the check layer too: blend's rows need not
    # equal HF's causal kernel's), but those whose sliding window is shorter than the prompt
    # (Gemma 3's local layers; Mistral's default 4096-token window masks nothing)
    assert len(calls) == _unwindowed_layers(engine, len(prompt.ids))
    # every layer rotates its fresh queries and keys with the native RoPE, and every layer but
    # the check layer (which compares fresh keys with the unrotated cache) its cached keys
    assert len(rotations) == 2 * engine.layers.num_layers + engine.layers.num_layers - 1
    assert 0 < got.stats.recomputed_fraction < 1
    assert torch.equal(got.fusion.selected, want.fusion.selected)
    torch.testing.assert_close(got.logits.float(), want.logits.float(), atol=3e-2, rtol=0)


def test_kernel_choice_follows_dtype_device_and_config(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert native.native_kernels("sdpa", torch.bfloat16, cpu, 64) is None
    assert native.native_kernels("auto", torch.float16, cpu, 64) is None
    assert native.native_kernels("auto", torch.float32, cpu, 24) is None  # head dim 24
    assert native.native_kernels("auto", torch.bfloat16, torch.device("cuda"), 64) is None
    with pytest.raises(RagblendError, match="bf16 models .* on CPU; this model is torch.float16"):
        native.native_kernels("native", torch.float16, cpu, 64)
    with pytest.raises(RagblendError, match="unknown row_attention 'flash'"):
        native.native_kernels("flash", torch.bfloat16, cpu, 64)
    with pytest.raises(RagblendError, match="unknown row_attention"):
        BlendConfig(row_attention="flash")  # type: ignore[arg-type]

    # a CPU below avx512_bf16: auto quietly takes SDPA blocks, native names what is missing
    monkeypatch.setenv("RAGBLEND_CPU_ISA", "avx2")
    assert native.native_kernels("auto", torch.bfloat16, cpu, 64) is None
    wanted = "need CPU level avx512_bf16; this CPU is at level avx2"
    with pytest.raises(RagblendError, match=wanted):
        native.native_kernels("native", torch.bfloat16, cpu, 64)


def test_a_capable_cpu_that_cannot_build_the_kernel_warns_and_uses_sdpa(monkeypatch, caplog):
    def no_compiler(*_):
        raise RagblendError("could not build ragblend's native kernels: no c++")

    monkeypatch.setattr(native, "cpu_runs_kernel", lambda *_: True)
    monkeypatch.setattr(native, "build_kernels", no_compiler)
    monkeypatch.setattr(native, "_WARNED", set())
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="ragblend.kernels.cpu.native"):
        assert native.native_kernels("auto", torch.bfloat16, cpu, 64) is None
        assert native.native_kernels("auto", torch.bfloat16, cpu, 64) is None  # a 2nd engine
    assert caplog.text.count("no c++") == 1 and "SDPA blocks" in caplog.text
    with pytest.raises(RagblendError, match="no c\\+\\+"):
        native.native_kernels("native", torch.bfloat16, cpu, 64)


def test_a_failed_build_is_tried_once_per_process(monkeypatch):
    calls = []

    def failing_compile(dtype):
        calls.append(dtype)
        raise RagblendError("could not build ragblend's native kernels: no c++")

    monkeypatch.setattr(native, "cpu_runs_kernel", lambda *_: True)
    monkeypatch.setattr(native, "_compiled", failing_compile)
    monkeypatch.setattr(native, "_BUILT", {})
    for _ in range(3):
        with pytest.raises(RagblendError, match="no c\\+\\+"):
            native.build_kernels(torch.float32)
    assert calls == [torch.float32]


@needs_bf16_level
@pytest.mark.parametrize("family", FAMILIES)
def test_native_rope_rotates_in_place_bit_for_bit_as_hf(family, tokenizer):
    model = tiny_model(family, dtype=torch.bfloat16, hidden_size=128, head_dim=32)
    engine = engine_for(model, tokenizer)
    layers = engine.layers
    assert layers.rope_rotates_half
    torch.manual_seed(0)
    n = 700
    cos, sin = layers.rope(torch.arange(n), torch.zeros(1, n, 128, dtype=torch.bfloat16))
    k = torch.randn(1, 2, n, 32).bfloat16()
    _, want = layers._apply_rotary(k, k, cos, sin)  # HF's apply_rotary_pos_emb
    got = k.clone()
    assert engine.native.rope_(got, cos, sin).data_ptr() == got.data_ptr()
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="cos and sin"):
        engine.native.rope_(got, cos[:, :10], sin[:, :10])


@needs_bf16_level
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma3"])  # Llama's norm
def test_a_layer_with_the_native_rope_and_norm_equals_hf_bit_for_bit(family, tokenizer):
    model = tiny_model(family, dtype=torch.bfloat16, hidden_size=128, head_dim=32)
    layers = engine_for(model, tokenizer).layers
    assert layers.llama_rms_norms
    kernels = native.native_kernels("native", torch.bfloat16, torch.device("cpu"), 32)
    assert kernels is not None and kernels.rms_norm is not None
    torch.manual_seed(0)
    rows = torch.tensor(sorted(torch.randperm(400)[:90].tolist()))
    hidden = torch.randn(1, 90, 128).bfloat16()
    cos, sin = layers.rope(rows, hidden)
    want = layers.project(1, hidden, cos, sin)
    got = layers.project(1, hidden, cos, sin, kernels.rope_, kernels.rms_norm)
    for name in ("q", "k", "k_pre", "v"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    attn = torch.randn(1, 90, 128).bfloat16()
    want_out = layers.finish(1, hidden, attn)
    assert torch.equal(layers.finish(1, hidden, attn, kernels.rms_norm), want_out)


@needs_bf16_level
@pytest.mark.parametrize("width", [3, 8, 100, 576, 2048, 5120])
def test_native_rms_norm_equals_hf_bit_for_bit(width):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    kernels = native.native_kernels("native", torch.bfloat16, torch.device("cpu"), 64)
    assert kernels is not None and kernels.rms_norm is not None
    norm = LlamaRMSNorm(width, eps=1e-5).bfloat16()
    torch.manual_seed(width)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width) * 0.3 + 1)
    for scale in (1e-3, 1.0, 50.0):  # 1e-3: the variance is of the order of eps
        x = (torch.randn(2, 300, width) * scale).bfloat16()
        assert torch.equal(kernels.rms_norm(x, norm.weight, norm.variance_epsilon), norm(x))
    with pytest.raises(RuntimeError, match="weight must be"):
        kernels.rms_norm(x, norm.weight[1:], 1e-5)


def test_a_norm_kernel_that_differs_from_torch_is_not_used(caplog):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def hf(x, weight, eps):
        norm = LlamaRMSNorm(weight.numel(), eps=eps).bfloat16()
        with torch.no_grad():
            norm.weight.copy_(weight)
        return norm(x)

    def one_rounding_fewer(x, weight, eps):  # as F.rms_norm: off by one bf16 ulp at times
        x32 = x.float()
        return (weight * x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).bfloat16()

    assert native._rms_norm_if_exact(hf) is hf
    with caplog.at_level(logging.WARNING, logger="ragblend.kernels.cpu.native"):
        assert native._rms_norm_if_exact(one_rounding_fewer) is None
    assert "does not match torch" in caplog.text


def _unwindowed_layers(engine, n: int) -> int:
    layers = engine.layers
    return sum(
        1
        for layer in range(layers.num_layers)
        if layers.sliding_window(layer) is None or layers.sliding_window(layer) >= n
    )


@needs_bf16_level
def test_bf16_kernels_are_checked_against_hf_rope_and_sdpa_on_load():
    good = native.build_kernels(torch.bfloat16)

    def off_by_a_fifth(q, k, v, positions, scale):
        return good.attend_rows(q, k, v, positions, scale) * 1.2

    native._check_rows(good.attend_rows, good.rope_, torch.bfloat16)  # the build itself passes
    with pytest.raises(RagblendError, match="row attention does not match"):
        native._check_rows(off_by_a_fifth, good.rope_, torch.bfloat16)
    with pytest.raises(RagblendError, match="RoPE does not match"):
        native._check_rows(good.attend_rows, lambda k, cos, sin: k.mul_(cos), torch.bfloat16)
