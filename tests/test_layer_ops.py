"""The fused layer steps (ragblend.kernels.cuda.layer_ops) and joined linears: HF's values by
construction, one registered op per step, every family's ratio 1.0 still HF's full prefill."""

from __future__ import annotations

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from helpers import assert_matches_hf, engine_for, hf_forward, layer_kv
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    apply_rotary_pos_emb,
)

from ragblend import BlendConfig
from ragblend.errors import RagblendError
from ragblend.kernels.cuda import layer_ops
from ragblend.kernels.cuda.layer_ops import REFERENCE, LayerKernels
from ragblend.kernels.cuda.loading import layer_kernels, mismatch
from ragblend.models.joined import join_linears, joinable

GEN = torch.Generator().manual_seed(0)
DTYPES = [torch.float32, torch.bfloat16]


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=GEN).to(dtype)


# ---------------------------------------------------------------------- the references
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_norms_are_hf_llama_rms_norm_bit_for_bit(dtype):
    norm = LlamaRMSNorm(1000, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(rand(1000) * 0.3 + 1)
    x, delta = rand(5, 1000, dtype=dtype) * 7, rand(5, 1000, dtype=dtype)
    assert torch.equal(layer_ops.rms_norm(x, norm.weight, 1e-6), norm(x))
    total, normed = layer_ops.add_rms_norm(x, delta, norm.weight, 1e-6)
    assert torch.equal(total, x + delta) and torch.equal(normed, norm(x + delta))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_rope_is_hf_apply_rotary_pos_emb_bit_for_bit(dtype):
    q = rand(1, 9, 4, 16, dtype=dtype).transpose(1, 2)  # as projected: a transposed view
    k = rand(1, 9, 2, 16, dtype=dtype).transpose(1, 2)
    cos, sin = rand(1, 9, 16, dtype=dtype), rand(1, 9, 16, dtype=dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = layer_ops.rope_qk(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.is_contiguous() and got_k.is_contiguous()  # as a kernel writes them


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_reference_in_place_rope_is_the_adapters_rotate(family):
    from ragblend.models.adapters import adapter_for

    layers = adapter_for(tiny_model(family))
    k = rand(1, 2, 9, 16)
    cos, sin = rand(1, 9, 16), rand(1, 9, 16)
    want = layers.rotate_(k.clone(), cos, sin)
    got = k.clone()
    assert layer_ops.rope_inplace(got, cos, sin) is None
    assert torch.equal(got, want)


def test_reference_silu_product_is_llama_mlps():
    from transformers import LlamaConfig

    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=48, hidden_act="silu"))
    x = rand(3, 32)
    with torch.no_grad():
        got = mlp.down_proj(layer_ops.silu_mul(mlp.gate_proj(x), mlp.up_proj(x)))
        assert torch.equal(got, mlp(x))


def test_scatter_rows_writes_both_tensors_at_the_rows():
    k_all, v_all = rand(1, 2, 9, 16), rand(1, 2, 9, 16)
    rows = torch.tensor([1, 4, 8])
    k, v = rand(1, 2, 3, 16), rand(1, 2, 3, 16)
    want_k, want_v = k_all.clone(), v_all.clone()
    want_k[:, :, rows], want_v[:, :, rows] = k, v
    layer_ops.scatter_rows(k_all, v_all, rows, k, v)
    assert torch.equal(k_all, want_k) and torch.equal(v_all, want_v)


# ---------------------------------------------------------------------- choosing kernels
def test_layer_kernels_choice():
    cpu = torch.device("cpu")
    assert layer_kernels("hf", cpu, torch.float32) is None
    assert layer_kernels("auto", cpu, torch.float32) is None  # HF's until a GPU has checked
    assert layer_kernels("fused", cpu, torch.float32) == LayerKernels("torch")
    with pytest.raises(RagblendError, match="unknown layer_kernels 'triton'.*auto, hf, fused"):
        layer_kernels("triton", cpu, torch.float32)
    with pytest.raises(RagblendError, match="unknown layer_kernels"):
        BlendConfig(layer_kernels="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_load_check_accepts_the_references_and_names_a_wrong_step(dtype):
    cpu = torch.device("cpu")
    assert mismatch(REFERENCE, cpu, dtype) is None

    def off_by_a_bit(x, w, eps):
        return REFERENCE.rms_norm(x, w, eps) * 1.05

    wrong = REFERENCE._replace(name="wrong", rms_norm=off_by_a_bit)
    want = f"wrong rms_norm differs from the torch reference ({dtype})"
    assert mismatch(wrong, cpu, dtype) == want

    def broken(*args):
        raise RuntimeError("no kernel image for this device")

    crashing = REFERENCE._replace(name="crashing", scatter_rows=broken)
    assert "crashing scatter_rows fails on cpu" in str(mismatch(crashing, cpu, dtype))


def test_cpu_tensors_run_the_references_whatever_cuda_runs(monkeypatch):
    calls = []

    def spy(x, w, eps):
        calls.append(1)
        return REFERENCE.rms_norm(x, w, eps)

    monkeypatch.setattr(layer_ops, "_CUDA_IMPL", [REFERENCE._replace(rms_norm=spy)])
    layer_ops.rms_norm(rand(2, 8), rand(8), 1e-6)
    assert calls == []


# ---------------------------------------------------------------------- joined linears
def test_joined_linears_share_memory_and_keep_hf_outputs():
    model = tiny_model("qwen2")  # q/k/v with biases
    attn = model.model.layers[0].self_attn
    x = rand(1, 5, model.config.hidden_size)
    with torch.no_grad():
        want = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
        joined = join_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        assert joined is not None and joined.bias is not None and joined.is_current()
        assert attn.q_proj.weight.data_ptr() == joined.weight.data_ptr()
        assert sum(joined.sizes) == joined.weight.shape[0]
        for got, ref, module in zip(joined(x), want, (attn.q_proj, attn.k_proj, attn.v_proj)):
            torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
            assert torch.equal(module(x), ref)  # the module reads its rows of the join


def test_weights_joined_during_a_prefill_still_train():
    from ragblend.models.adapters import adapter_for

    model = tiny_model("llama")
    layers = adapter_for(model)
    with torch.inference_mode():  # as the fusor joins them
        joined = layers.joined(0, "qkv")
    assert joined is not None and not joined.weight.is_inference()
    model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_a_join_is_made_again_when_a_module_weight_is_replaced():
    from ragblend.models.adapters import adapter_for

    layers = adapter_for(tiny_model("llama"))
    first = layers.joined(0, "qkv")
    assert first is not None and layers.joined(0, "qkv") is first
    v_proj = layers.layers[0].self_attn.v_proj
    v_proj.weight = torch.nn.Parameter(v_proj.weight.detach().clone() * 2)
    assert not first.is_current()
    again = layers.joined(0, "qkv")
    assert again is not None and again is not first and again.is_current()
    assert torch.equal(again.weight[-v_proj.out_features :], v_proj.weight)


def test_only_plain_linears_of_one_kind_are_joined():
    a, b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4, bias=False)
    assert joinable([a, torch.nn.Linear(8, 6)])
    assert not joinable([a, b])  # bias on one only
    assert not joinable([a, torch.nn.Linear(6, 4)])  # another input width
    assert not joinable([a, torch.nn.Linear(8, 4).to(torch.bfloat16)])
    assert join_linears([a, torch.nn.Identity()]) is None
    assert not joinable([])


# ---------------------------------------------------------------------- end to end
@pytest.fixture(params=FAMILIES)
def fused_engine(request, tokenizer):
    model = tiny_model(request.param)
    engine = engine_for(model, tokenizer, ratio=1.0, row_attention="masked", layer_kernels="fused")
    engine.precompute(CHUNKS)
    return engine


def test_fused_steps_at_ratio_one_match_hf_full_prefill(fused_engine):
    engine = fused_engine
    assert engine.layer_kernels == LayerKernels("torch")
    prompt = engine.tokenize(QUESTION, CHUNKS)
    ref = hf_forward(engine.model, prompt.ids)
    out = engine.prefill(prompt, "blend")
    assert out.stats.recomputed_fraction == 1.0
    assert_matches_hf(out, ref, range(engine.layers.num_layers), atol=1e-4)


@pytest.mark.parametrize("mode", ["blend", "reuse"])
def test_fused_steps_give_the_hf_modules_blend_and_reuse(fused_engine, mode):
    fused = fused_engine.with_config(ratio=0.15)
    hf = fused.with_config(layer_kernels="hf")
    assert hf.layer_kernels is None and fused.layer_kernels is not None
    prompt = fused.tokenize(QUESTION, CHUNKS)
    a, b = fused.prefill(prompt, mode), hf.prefill(prompt, mode)
    assert torch.equal(a.fusion.selected, b.fusion.selected)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)
    for i in range(fused.layers.num_layers):
        for x, y in zip(layer_kv(a.cache, i), layer_kv(b.cache, i)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_native_cpu_kernels_take_precedence_over_the_fused_steps(tokenizer):
    from ragblend.kernels.cpu.native import cpu_runs_kernel

    if not cpu_runs_kernel(torch.float32):
        pytest.skip("this CPU runs no native fp32 kernels")
    engine = engine_for(tiny_model("llama"), tokenizer, layer_kernels="fused")
    assert engine.row_attention == "native" and engine.layer_kernels is None
