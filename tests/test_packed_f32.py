"""fp32 decode steps on prepacked oneDNN weights: the same values to rounding, each row the same
in any batch, and a second copy only where it fits."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import CHUNKS, QUESTION, tiny_model
from torch import nn

from ragblend import BlendConfig, BlendEngine
from ragblend.models import packed as packing
from ragblend.models.packed import (
    DECODE_ROWS,
    cpu_packs,
    pack_decode_linears,
    qkv_projections,
    unpack_decode_linears,
)

pytestmark = pytest.mark.skipif(
    not cpu_packs(torch.float32), reason="this torch build has no oneDNN linear prepacking"
)


def test_each_rows_output_is_the_same_in_any_decode_batch_and_equals_f_linear_to_rounding():
    torch.manual_seed(0)
    for out_f, in_f, bias in [(1536, 576, False), (192, 576, True), (49, 64, True)]:
        layer = nn.Linear(in_f, out_f, bias=bias)
        x = torch.randn(1, DECODE_ROWS + 1, in_f)
        with torch.inference_mode():
            want = F.linear(x, layer.weight, layer.bias)
            assert pack_decode_linears(layer) == 1
            batch = layer(x[:, :DECODE_ROWS])
            for rows in range(1, DECODE_ROWS):
                assert torch.equal(layer(x[:, :rows]), batch[:, :rows])
            torch.testing.assert_close(batch, want[:, :DECODE_ROWS], atol=1e-5, rtol=1e-5)
            # a prefill (more rows than a decode step) is F.linear's, bit for bit
            assert torch.equal(layer(x), want)
        unpack_decode_linears(layer)
        assert "forward" not in vars(layer)


@pytest.mark.parametrize("shape", [(256, 2048), (128, 4096)])
def test_rows_stay_the_same_in_any_batch_where_onednn_sums_more_rows_in_another_order(shape):
    # oneDNN's fp32 kernel for 2+ rows of these shapes sums in another order than for one
    # (Zen 5, AVX512): the probe made when packing cuts batches to one row per call there
    torch.manual_seed(0)
    layer = nn.Linear(shape[1], shape[0], bias=False)
    x = torch.randn(DECODE_ROWS, shape[1])
    with torch.inference_mode():
        want = F.linear(x, layer.weight)
        pack_decode_linears(layer)
        alone = torch.cat([layer(x[i : i + 1]) for i in range(DECODE_ROWS)])
        for rows in range(2, DECODE_ROWS + 1):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
        torch.testing.assert_close(alone, want, atol=1e-4, rtol=1e-5)


def test_fused_qkv_and_gate_up_give_each_rows_values_whatever_the_batch():
    torch.manual_seed(0)
    model = tiny_model("qwen3")
    block = model.model.layers[0]
    x = torch.randn(1, 5, model.config.hidden_size)
    with torch.inference_mode():
        want_q = block.self_attn.q_proj(x)
        want_mlp = block.mlp(x)
        assert pack_decode_linears(model) > 0
        q5, k5, v5 = qkv_projections(block.self_attn, x)
        q1, k1, v1 = qkv_projections(block.self_attn, x[:, :1])
        assert torch.equal(q1, q5[:, :1]) and torch.equal(k1, k5[:, :1])
        assert torch.equal(v1, v5[:, :1])
        torch.testing.assert_close(q5, want_q, atol=1e-5, rtol=1e-5)
        assert torch.equal(block.mlp(x[:, :1]), block.mlp(x)[:, :1])
        torch.testing.assert_close(block.mlp(x), want_mlp, atol=1e-5, rtol=1e-5)


def test_no_second_copy_when_it_would_take_over_half_the_available_memory(
    monkeypatch, tokenizer, caplog
):
    model = tiny_model("llama")
    weights = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))
    monkeypatch.setattr(packing, "available_memory", lambda: 2 * weights - 1)
    engine = BlendEngine(model, tokenizer, BlendConfig(packed_decode=True))
    with caplog.at_level(logging.INFO, logger="ragblend.models.packed"):
        short = engine.generate(QUESTION, CHUNKS, mode="full", max_new_tokens=6)
        engine.generate(QUESTION, CHUNKS, mode="full", max_new_tokens=2)
    assert not any("forward" in vars(m) for m in model.modules())
    assert caplog.text.count("more than half the available memory") == 1

    roomy = tiny_model("llama")
    monkeypatch.setattr(packing, "available_memory", lambda: 2 * weights)
    engine = BlendEngine(roomy, tokenizer, BlendConfig(packed_decode=True))
    packed = engine.generate(QUESTION, CHUNKS, mode="full", max_new_tokens=6)
    assert any("forward" in vars(m) for m in roomy.modules())
    assert packed.token_ids == short.token_ids
