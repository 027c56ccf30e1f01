"""The native fp32 kernels (any CPU at the avx2 level): selected-row attention equals the
per-row reference to fp32 rounding, RoPE equals HF's bit for bit, and blend runs on them.

Oracle: the per-row reference in float64 on the same fp32 inputs; SDPA's error against it is
of the order of 1e-6, and the kernel is held to ATOL.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import engine_for
from test_fusion_mask_and_selection import _reference_rows

from ragblend.errors import RagblendError
from ragblend.kernels.cpu import native

ATOL = 2e-5
F32 = torch.float32
CPU = torch.device("cpu")

pytestmark = pytest.mark.skipif(
    not native.cpu_runs_kernel(F32), reason="the native fp32 kernels need the avx2 level"
)


def _kernels() -> native.NativeKernels:
    kernels = native.native_kernels("native", F32, CPU, 64)
    assert kernels is not None and kernels.dtype == F32
    return kernels


def _inputs(n, rows, heads, kv_heads, dim, seed=0):
    torch.manual_seed(seed)
    positions = torch.tensor(sorted(torch.randperm(n)[:rows].tolist()))
    q = torch.randn(1, rows, heads, dim).transpose(1, 2)  # a transposed view, as the fusor's
    return q, torch.randn(1, kv_heads, n, dim), torch.randn(1, kv_heads, n, dim), positions


@pytest.mark.parametrize(
    ("n", "rows", "heads", "kv_heads", "dim"),
    [
        (1300, 200, 9, 3, 64),  # SmolLM2's shape: 3 query heads per KV head, 6 key blocks
        (700, 301, 4, 4, 32),  # no GQA, a partial last tile
        (257, 40, 8, 2, 128),
        (90, 90, 4, 2, 16),  # every row: the causal case
        (600, 1, 2, 1, 64),  # one row
        (513, 7, 6, 3, 48),  # a key block of one key; rows whose count ends mid-vector
    ],
)
def test_kernel_matches_the_per_row_reference(n, rows, heads, kv_heads, dim):
    q, k, v, positions = _inputs(n, rows, heads, kv_heads, dim)
    got = _kernels().attend_rows(q, k, v, positions, 0.125)
    assert got.shape == (1, rows, heads * dim) and got.dtype == F32
    ref = _reference_rows(q.double(), k.double(), v.double(), positions, 0.125)
    assert float((got.double() - ref).abs().max()) < ATOL


def test_a_row_never_sees_a_later_key():
    q, k, v, positions = _inputs(800, 50, 4, 2, 64, seed=1)
    attend = _kernels().attend_rows
    before = attend(q, k, v, positions, 0.125)
    k2, v2 = k.clone(), v.clone()
    last = int(positions[-1])
    k2[:, :, last + 1 :] = 1e3  # huge keys and values after the last row: must not leak
    v2[:, :, last + 1 :] = 1e3
    middle = int(positions[25])
    k2[:, :, middle + 1 : last] = -7.0  # visible only to the rows after `middle`
    after = attend(q, k2, v2, positions, 0.125)
    assert torch.equal(after[:, :26], before[:, :26])
    assert not torch.equal(after[:, 26:], before[:, 26:])


def test_bad_inputs_are_one_clear_error():
    q, k, v, positions = _inputs(100, 10, 4, 2, 64)
    attend = _kernels().attend_rows
    with pytest.raises(RuntimeError, match="ascending"):
        attend(q, k, v, positions.flip(0).contiguous(), 0.125)
    with pytest.raises(RuntimeError, match="outside 100 keys"):
        attend(q, k, v, positions + 100, 0.125)
    with pytest.raises(RuntimeError, match="float32"):
        attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), positions, 0.125)


@pytest.mark.parametrize("family", FAMILIES)
def test_native_rope_and_a_layer_with_it_equal_hf_bit_for_bit(family, tokenizer):
    model = tiny_model(family, dtype=F32, hidden_size=128, head_dim=32)
    layers = engine_for(model, tokenizer).layers
    assert layers.rope_rotates_half
    rope_ = _kernels().rope_
    torch.manual_seed(0)
    n = 700
    cos, sin = layers.rope(torch.arange(n), torch.zeros(1, n, 128))
    k = torch.randn(1, 2, n, 32)
    _, want = layers._apply_rotary(k, k, cos, sin)  # HF's apply_rotary_pos_emb
    got = k.clone()
    assert rope_(got, cos, sin).data_ptr() == got.data_ptr()
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="cos and sin"):
        rope_(got, cos[:, :10], sin[:, :10])
    rows = torch.tensor(sorted(torch.randperm(400)[:90].tolist()))
    hidden = torch.randn(1, 90, 128)
    cos, sin = layers.rope(rows, hidden)
    want_proj = layers.project(1, hidden, cos, sin)
    got_proj = layers.project(1, hidden, cos, sin, rope_)
    for name in ("q", "k", "k_pre", "v"):
        assert torch.equal(getattr(got_proj, name), getattr(want_proj, name)), name


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_blend_runs_the_kernels_and_matches_sdpa_blocks(family, tokenizer):
    model = tiny_model(family, dtype=F32, hidden_size=128, head_dim=32)
    engine = engine_for(model, tokenizer, ratio=0.3, check_layers=(1,), check_scales=None)
    assert engine.row_attention == "native"
    sdpa = engine.with_config(row_attention="sdpa")
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
    assert len(rotations) == 2 * engine.layers.num_layers + engine.layers.num_layers - 1
    assert 0 < got.stats.recomputed_fraction < 1
    assert torch.equal(got.fusion.selected, want.fusion.selected)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=0)


def test_kernels_that_fail_the_load_check_are_not_used(monkeypatch, caplog):
    good = _kernels()

    def off_by_a_little(q, k, v, positions, scale):
        return good.attend_rows(q, k, v, positions, scale) * 1.001

    with pytest.raises(RagblendError, match="row attention does not match"):
        native._check_rows(off_by_a_little, good.rope_, F32)
    with pytest.raises(RagblendError, match="RoPE does not match"):
        native._check_rows(good.attend_rows, lambda k, cos, sin: k.mul_(cos), F32)

    def failing_build(*_):
        raise RagblendError("the native fp32 RoPE does not match HF's bit for bit")

    monkeypatch.setattr(native, "build_kernels", failing_build)
    monkeypatch.setattr(native, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="ragblend.kernels.cpu.native"):
        assert native.native_kernels("auto", F32, CPU, 64) is None
    assert "does not match" in caplog.text and "SDPA blocks instead" in caplog.text


def test_below_the_avx2_level_fp32_blend_takes_sdpa_blocks(monkeypatch):
    monkeypatch.setenv("RAGBLEND_CPU_ISA", "baseline")
    assert native.native_kernels("auto", F32, CPU, 64) is None
    with pytest.raises(RagblendError, match="need CPU level avx2; this CPU is at level baseline"):
        native.native_kernels("native", F32, CPU, 64)


@pytest.mark.parametrize("width", [3, 8, 100, 576, 2048, 5120])
def test_native_rms_norm_equals_hf_bit_for_bit(width):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm_kernel = _kernels().rms_norm
    assert norm_kernel is not None
    norm = LlamaRMSNorm(width, eps=1e-5)
    torch.manual_seed(width)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width) * 0.3 + 1)
    for scale in (1e-3, 1.0, 50.0):  # 1e-3: the variance is of the order of eps
        x = torch.randn(2, 300, width) * scale
        assert torch.equal(norm_kernel(x, norm.weight, norm.variance_epsilon), norm(x))
    with pytest.raises(RuntimeError, match="weight must be"):
        norm_kernel(x, norm.weight[1:], 1e-5)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma3"])  # Llama's norm
def test_a_layer_with_the_native_rope_and_norm_equals_hf_bit_for_bit(family, tokenizer):
    model = tiny_model(family, dtype=F32, hidden_size=128, head_dim=32)
    layers = engine_for(model, tokenizer).layers
    assert layers.llama_rms_norms
    kernels = _kernels()
    torch.manual_seed(0)
    rows = torch.tensor(sorted(torch.randperm(400)[:90].tolist()))
    hidden = torch.randn(1, 90, 128)
    cos, sin = layers.rope(rows, hidden)
    want = layers.project(1, hidden, cos, sin)
    got = layers.project(1, hidden, cos, sin, kernels.rope_, kernels.rms_norm)
    for name in ("q", "k", "k_pre", "v"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    attn = torch.randn(1, 90, 128)
    assert torch.equal(
        layers.finish(1, hidden, attn, kernels.rms_norm), layers.finish(1, hidden, attn)
    )


def _unwindowed_layers(engine, n: int) -> int:
    layers = engine.layers
    return sum(
        1
        for layer in range(layers.num_layers)
        if layers.sliding_window(layer) is None or layers.sliding_window(layer) >= n
    )
