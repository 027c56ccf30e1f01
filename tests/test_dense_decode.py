"""bf16 decode steps on ragblend's native dense kernel: F.linear's values to a bf16 ulp, each
row the same in any batch, and models that decode as they do unpacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import CHUNKS, QUESTION, tiny_model
from test_batch_decode import PROMPTS, greedy, start
from torch import nn

from ragblend import BlendConfig, BlendEngine, cpu
from ragblend.models import dense_decode
from ragblend.models import packed as packing
from ragblend.models.dense_decode import MAX_ROWS, dense_kernel, tolerance

pytestmark = pytest.mark.skipif(
    not cpu.isa_at_least(dense_decode.LEVEL),
    reason=f"the native bf16 kernel needs CPU level avx512; this one is at {cpu.cpu_isa()}",
)

# SmolLM2-135M's proportions, smaller: head_dim 64, 3 query heads per K/V head, tied embeddings
SMOL = dict(hidden_size=192, intermediate_size=512, num_attention_heads=3, num_key_value_heads=1)


@pytest.fixture(scope="module")
def kernel() -> dense_decode.DenseKernel:
    built = dense_kernel()
    if built is None:
        pytest.skip("the native bf16 kernel did not build here (no compiler?): see the warning")
    return built


def _random(rows: int, cols: int, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cols, generator=gen).bfloat16()
    weight = (torch.randn(rows, cols, generator=gen) / cols**0.5).bfloat16()
    return x, weight, torch.randn(rows, generator=gen).bfloat16()


@pytest.mark.parametrize(
    "rows,cols,n", [(576, 576, 1), (192, 576, 2), (1536, 576, 5), (77, 1536, 16), (93, 4096, 3)]
)
def test_outputs_equal_f_linear_within_a_bf16_ulp_with_and_without_bias(kernel, rows, cols, n):
    x, weight, bias = _random(rows, cols, n, seed=rows + n)
    for b in (None, bias):
        got, want = kernel.matmul(x, weight, b), F.linear(x, weight, b)
        assert got.dtype == torch.bfloat16 and got.shape == (n, rows)
        diff = (got.float() - want.float()).abs()
        assert bool((diff <= tolerance(x, weight, got, want)).all())
        assert (got != want).float().mean() < 0.01  # a flipped rounding is rare


@pytest.mark.parametrize("rows,cols", [(67, 576), (1536, 576), (13, 1536)])
def test_each_rows_output_is_the_same_alone_and_in_batches_of_2_to_16(kernel, rows, cols):
    x, weight, bias = _random(rows, cols, MAX_ROWS, seed=cols)
    alone = torch.cat([kernel.matmul(x[i : i + 1], weight, bias) for i in range(MAX_ROWS)])
    for n in range(2, MAX_ROWS + 1):
        assert torch.equal(kernel.matmul(x[:n], weight, bias), alone[:n]), n
        assert torch.equal(kernel.matmul(x[MAX_ROWS - n :], weight, bias), alone[MAX_ROWS - n :])


def test_matmul_cat_is_its_weights_matmuls_side_by_side(kernel):
    x, q, bias = _random(576, 576, 4, seed=1)
    _, k, _ = _random(192, 576, 4, seed=2)
    cat = kernel.matmul_cat(x, [q, k, k], [bias, None, None])
    parts = [kernel.matmul(x, q, bias), kernel.matmul(x, k, None), kernel.matmul(x, k, None)]
    assert torch.equal(cat, torch.cat(parts, dim=1))


def test_the_kernel_refuses_what_it_does_not_take(kernel):
    x, weight, _ = _random(8, 48, 1, seed=0)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.matmul(x, weight, None)
    x, weight, _ = _random(8, 64, MAX_ROWS + 1, seed=0)
    with pytest.raises(RuntimeError, match="rows"):
        kernel.matmul(x, weight, None)


def test_a_weight_whose_columns_are_no_multiple_of_32_keeps_f_linear(kernel):
    torch.manual_seed(0)
    layer = nn.Linear(48, 40, bias=True).to(torch.bfloat16)
    wide = nn.Linear(64, 40, bias=True).to(torch.bfloat16)
    assert not dense_decode.supports(layer.weight) and dense_decode.supports(wide.weight)
    x = torch.randn(1, 3, 48, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert packing.pack_decode_linears(layer) == (1 if packing.cpu_packs() else 0)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # 3 rows: F.linear
        assert torch.equal(layer(x[:, :1]), F.linear(x[:, :1], layer.weight, layer.bias))
    packing.unpack_decode_linears(layer)


def test_below_the_avx512_level_there_is_no_kernel(monkeypatch):
    monkeypatch.setenv(cpu.ENV_CAP, "avx2")
    assert dense_kernel() is None


def test_a_packed_bf16_model_decodes_the_tokens_it_decodes_unpacked(kernel, tokenizer):
    def answer(packed: bool) -> list[int]:
        model = tiny_model("llama", dtype=torch.bfloat16, **SMOL)
        engine = BlendEngine(model, tokenizer, BlendConfig(packed_decode=packed))
        ids = engine.generate(QUESTION, CHUNKS, mode="full", max_new_tokens=8).token_ids
        assert packing.is_packed(model) == packed
        return ids

    packed = answer(True)
    assert len(packed) == 8 and packed == answer(False)


def test_each_requests_logits_in_a_packed_bf16_batch_equal_its_logits_alone(kernel, tokenizer):
    model = tiny_model("llama", dtype=torch.bfloat16, **SMOL)
    engine = BlendEngine(model, tokenizer, BlendConfig(dtype="bfloat16"))
    engine.prepare_decode()
    attn = model.model.layers[0].self_attn
    assert packing.is_packed(model) and packing._QKV in vars(attn)
    assert vars(attn)[packing._QKV].rows == MAX_ROWS  # the native path, not oneDNN's one row
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    steps = 5

    def run(batch: list[list[int]]):
        started = [start(engine, ids, steps) for ids in batch]
        return greedy(engine, [d for d, _ in started], [f for _, f in started], steps)

    alone = [run([ids]) for ids in prompts]
    together, logits = run(prompts)
    assert together == [ids[0] for ids, _ in alone]
    for b, (_, single) in enumerate(alone):
        assert all(torch.equal(batch[b], step[0]) for batch, step in zip(logits, single))
