"""A GGUF's quantized tensors kept as blocks: the same prefill as the dequantized model, decode
rows on the blocks identical alone and batched, types without a kernel dequantized with a log.

Tiny models of each family (hidden 256, so the K-quants' 256-weight blocks fit) are written as
GGUF files with a mix of quantized types, then loaded twice: ``weights="auto"`` (blocks kept)
and ``weights="dequantize"`` (every weight dense, the behaviour before quantized kernels)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import CHUNKS, FAMILIES, QUESTION, tiny_model
from gguf_files import write_gguf
from torch import nn

from ragblend import BlendConfig, BlendEngine
from ragblend.decode.decoder import LayerDecoder, decode_batch
from ragblend.kernels.cpu.quant_kernels import quant_kernels
from ragblend.models.loading import load_model
from ragblend.models.packed import pack_decode_linears, qkv_projections
from ragblend.models.quantized import (
    QuantEmbedding,
    QuantLinear,
    keep_dense_weights,
    quantized_weights,
)
from ragblend.store.keys import model_fingerprint

SIZES = dict(hidden_size=256, intermediate_size=512)
# every kernel type on some matrix; the embedding (and the tied LM head) Q8_0
MIX = {
    "token_embd": "Q8_0",
    "attn_q": "Q4_K",
    "attn_k": "Q5_K",
    "attn_v": "Q6_K",
    "attn_output": "Q4_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q5_0",
    "ffn_down": "Q5_1",
}
LONG = list(range(300, 340))  # 40 tokens: a prefill (more rows than a decode step)


def _write(family: str, tmp_path, mix=MIX):
    overrides = dict(SIZES)
    if family == "gemma3":
        overrides |= dict(
            num_hidden_layers=6, layer_types=["sliding_attention"] * 5 + ["full_attention"]
        )
        overrides |= dict(final_logit_softcapping=None)
    return write_gguf(
        tiny_model(family, **overrides), family, tmp_path / f"{family}.gguf", quant=mix
    )


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGBLEND_HOME", str(tmp_path / "home"))


def _logits(model, ids) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_kept_blocks_prefill_exactly_as_the_dequantized_model(family, tmp_path):
    path = _write(family, tmp_path)
    kept, _ = load_model(path, dtype="float32")
    dense, _ = load_model(path, dtype="float32", weights="dequantize")
    assert not any(isinstance(m, QuantLinear | QuantEmbedding) for m in dense.modules())
    linears = [m for m in kept.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 7 * kept.config.num_hidden_layers + 1  # the tied LM head too
    assert isinstance(kept.get_input_embeddings(), QuantEmbedding)
    # a prefill: the gguf package's values in F.linear, bit for bit
    assert torch.equal(_logits(kept, LONG), _logits(dense, LONG))
    # a decode-sized input runs on the blocks: the same to fp32 rounding
    torch.testing.assert_close(
        _logits(kept, LONG[:3]), _logits(dense, LONG[:3]), atol=1e-4, rtol=1e-4
    )
    # one fingerprint whether the blocks are kept or not: their chunk caches are the same
    assert model_fingerprint(kept) == model_fingerprint(dense)


def test_a_small_models_prefills_keep_the_dense_weights_they_make(tmp_path):
    path = _write("llama", tmp_path)
    kept, _ = load_model(path, dtype="float32")
    dense, _ = load_model(path, dtype="float32", weights="dequantize")
    linears = [m for m in kept.modules() if isinstance(m, QuantLinear)]
    assert all(m.qweight.keep_dense and m.qweight._dense is None for m in linears)
    first = _logits(kept, LONG)
    made = {id(m.qweight): m.qweight._dense for m in linears}
    assert all(t is not None for t in made.values())  # the LM head ran on every row too
    for m in linears:  # the values a dequantizing load holds, bit for bit
        assert torch.equal(m.qweight._dense, m.qweight.dequantize(torch.float32))
    again = _logits(kept, LONG)
    assert all(m.qweight._dense is made[id(m.qweight)] for m in linears)  # reused, not remade
    assert torch.equal(first, again) and torch.equal(again, _logits(dense, LONG))


def test_a_model_over_the_budget_dequantizes_in_every_prefill(tmp_path):
    path = _write("llama", tmp_path)
    model, _ = load_model(path, dtype="float32")
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    # the tied LM head shares the embedding's weight: counted once
    total = sum(
        4 * m.in_features * m.out_features for m in {id(m.qweight): m for m in linears}.values()
    )
    assert keep_dense_weights(model, budget=total)
    assert not keep_dense_weights(model, budget=total - 1)
    logits = _logits(model, LONG)
    assert all(m.qweight._dense is None for m in linears)
    assert torch.equal(logits, _logits(load_model(path, dtype="float32")[0], LONG))


@pytest.mark.parametrize("family", FAMILIES)
def test_blend_at_ratio_one_on_kept_blocks_is_full_prefill(family, tmp_path):
    path = _write(family, tmp_path)
    engine = BlendEngine.from_pretrained(str(path), config=BlendConfig(dtype="float32", ratio=1.0))
    assert quantized_weights(engine.model)
    engine.precompute(CHUNKS)
    prompt = engine.tokenize(QUESTION, CHUNKS)
    full = engine.prefill(prompt, "full")
    blend = engine.prefill(prompt, "blend")
    kl = torch.nn.functional.kl_div(
        blend.logits.log_softmax(-1), full.logits.log_softmax(-1), log_target=True, reduction="sum"
    )
    assert float(kl) <= 1e-6
    for mode in ("full", "prefix", "reuse", "blend"):
        result = engine.generate(QUESTION, CHUNKS, mode=mode, max_new_tokens=4)
        assert result.stats.mode == mode
    kind = "-int8" if engine.decode_activations == "int8" else "-native"
    assert engine.decode_path.endswith(kind if quant_kernels() else "-dequantize")


@pytest.mark.skipif(quant_kernels() is None, reason="the quantized kernels do not run on this CPU")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decode_rows_on_blocks_are_identical_alone_and_batched(family, tmp_path):
    path = _write(family, tmp_path)
    engine = BlendEngine.from_pretrained(str(path), config=BlendConfig(dtype="float32"))
    prompts = [engine.tokenize(QUESTION, CHUNKS[:n]).ids for n in (1, 2, 3)]
    prefills = [engine.full_prefill(ids) for ids in prompts]
    decoders = [
        LayerDecoder.for_cache(engine.layers, p.cache, len(ids), len(ids) + 4, engine.native)
        for p, ids in zip(prefills, prompts, strict=True)
    ]
    tokens = [int(p.logits.argmax()) for p in prefills]
    batched = decode_batch(decoders, tokens)
    for i, ids in enumerate(prompts):
        alone = LayerDecoder.for_cache(
            engine.layers, prefills[i].cache, len(ids), len(ids) + 4, engine.native
        )
        assert torch.equal(alone.step(tokens[i]), batched[i])


@pytest.mark.skipif(quant_kernels() is None, reason="the quantized kernels do not run on this CPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_fused_qkv_and_gate_up_on_blocks_decode_as_the_separate_linears(family, dtype, tmp_path):
    path = _write(family, tmp_path)
    engine = BlendEngine.from_pretrained(str(path), config=BlendConfig(dtype=dtype))
    ids = engine.tokenize(QUESTION, CHUNKS[:2]).ids
    prefill = engine.full_prefill(ids)
    token = int(prefill.logits.argmax())

    def step() -> torch.Tensor:
        decoder = LayerDecoder.for_cache(
            engine.layers, prefill.cache, len(ids), len(ids) + 2, engine.native
        )
        return decoder.step(token)

    separate = step()
    assert pack_decode_linears(engine.model) == 5 * engine.model.config.num_hidden_layers
    attn = engine.model.model.layers[0].self_attn
    x = torch.randn(3, 1, 256).to(getattr(torch, dtype))
    fused = qkv_projections(attn, x)
    for got, linear in zip(fused, (attn.q_proj, attn.k_proj, attn.v_proj), strict=True):
        assert torch.equal(got, linear(x))
    assert torch.equal(step(), separate)


def test_types_without_a_kernel_load_dequantized_with_one_log_line(tmp_path, caplog):
    mix = dict(MIX, ffn_up="TQ2_0")  # ternary: no kernel for it
    path = _write("llama", tmp_path, mix)
    with caplog.at_level(logging.INFO, logger="ragblend.models"):
        model, _ = load_model(path, dtype="float32")
    lines = [r.getMessage() for r in caplog.records if "no kernel" in r.getMessage()]
    assert len(lines) == 1 and "TQ2_0" in lines[0]
    assert all(type(layer.mlp.up_proj) is nn.Linear for layer in model.model.layers)
    assert all(isinstance(layer.mlp.gate_proj, QuantLinear) for layer in model.model.layers)
    dense, _ = load_model(path, dtype="float32", weights="dequantize")
    assert torch.equal(_logits(model, LONG), _logits(dense, LONG))


def test_unknown_weights_choice_is_one_clear_error():
    from ragblend.errors import RagblendError

    with pytest.raises(RagblendError, match="unknown weights"):
        BlendConfig(weights="int4")


def test_q4_k_m_mix_falls_back_where_rows_are_not_k_blocks_as_llama_cpp_does():
    from ragblend.bench.random_gguf import tensor_type

    assert tensor_type("blk.0.ffn_up.weight", "Q4_K_M", 24, 4096) == "Q4_K"
    assert tensor_type("blk.0.attn_q.weight", "Q4_K_M", 24, 896) == "Q5_0"  # Qwen2.5-0.5B
    assert tensor_type("blk.0.ffn_down.weight", "Q4_K_M", 24, 896) == "Q8_0"  # a Q6_K layer
    assert tensor_type("output.weight", "Q4_K_M", 24, 4864) == "Q6_K"
    assert tensor_type("blk.3.attn_v.weight", "Q8_0", 24, 896) == "Q8_0"
