"""One-row bf16 linears on prepacked oneDNN weights: identical outputs, only where they apply.

This is bf16's path where ragblend's native kernel does not run (below the avx512 level, or a
failed build), so these tests turn the kernel off; tests/test_dense_decode.py tests it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from torch import nn

from ragblend import BlendConfig, BlendEngine, cpu
from ragblend.models import packed as packing
from ragblend.models.packed import (
    cpu_packs,
    pack_decode_linears,
    qkv_projections,
    unpack_decode_linears,
)

pytestmark = pytest.mark.skipif(
    not cpu_packs(),
    reason=f"oneDNN packs bf16 weights with AVX512 or AVX-NE-CONVERT; CPU level {cpu.cpu_isa()}",
)


@pytest.fixture(autouse=True)
def _no_native_kernel(monkeypatch):
    monkeypatch.setattr(packing, "native_bf16", lambda: None)


def test_one_row_inputs_equal_f_linear_bit_for_bit_and_other_inputs_go_to_f_linear():
    torch.manual_seed(0)
    for out_f, in_f, bias in [(1536, 576, False), (192, 576, True), (49, 64, True), (7, 3, False)]:
        layer = nn.Linear(in_f, out_f, bias=bias).to(torch.bfloat16)
        x1 = torch.randn(1, 1, in_f, dtype=torch.bfloat16)
        x5 = torch.randn(1, 5, in_f, dtype=torch.bfloat16)
        with torch.inference_mode():
            want1, want5 = layer(x1), layer(x5)
            assert pack_decode_linears(layer) == 1
            assert torch.equal(layer(x1), want1) and torch.equal(layer(x5), want5)
            assert torch.equal(layer(x1), F.linear(x1, layer.weight, layer.bias))
        unpack_decode_linears(layer)
        assert "forward" not in vars(layer)


def test_only_bf16_and_fp32_cpu_linears_are_packed():
    assert pack_decode_linears(nn.Linear(4, 4).to(torch.float16)) == 0
    assert pack_decode_linears(nn.Linear(4, 4)) == 1  # fp32 decode linears are packed too
    model = tiny_model("llama", dtype=torch.bfloat16)
    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    assert pack_decode_linears(model) == linears
    assert pack_decode_linears(model) == 0  # already packed


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_qkv_and_gate_up_equal_the_separate_linears_bit_for_bit(family):
    torch.manual_seed(0)
    model = tiny_model(family, dtype=torch.bfloat16)
    block = model.model.layers[0]
    attn, mlp = block.self_attn, block.mlp
    x1 = torch.randn(1, 1, model.config.hidden_size, dtype=torch.bfloat16)
    x5 = torch.randn(1, 5, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.inference_mode():
        want_qkv = attn.q_proj(x1), attn.k_proj(x1), attn.v_proj(x1)
        want_mlp1, want_mlp5 = mlp(x1), mlp(x5)
        pack_decode_linears(model)
        assert packing._QKV in vars(attn) and "forward" in vars(mlp)  # the fused paths exist
        got_qkv = qkv_projections(attn, x1)
        assert all(torch.equal(g, w) for g, w in zip(got_qkv, want_qkv, strict=True))
        assert torch.equal(mlp(x1), want_mlp1) and torch.equal(mlp(x5), want_mlp5)
        unpack_decode_linears(model)
        assert packing._QKV not in vars(attn) and "forward" not in vars(mlp)
        assert torch.equal(mlp(x1), want_mlp1)


def _packed(model: nn.Module) -> bool:
    return any("forward" in vars(m) for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_decode_answers_exactly_as_unpacked(family, tokenizer):
    def answer(packed: bool):
        model = tiny_model(family, dtype=torch.bfloat16)
        engine = BlendEngine(model, tokenizer, BlendConfig(packed_decode=packed))
        assert not _packed(model)  # not at start-up: only a decoding engine packs
        ids = engine.generate(QUESTION, CHUNKS, mode="full", max_new_tokens=12).token_ids
        assert _packed(model) == packed
        return ids

    packed = answer(True)
    assert len(packed) == 12 and packed == answer(False)
