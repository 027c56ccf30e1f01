"""bf16 decode steps on ragblend's native dense kernel: F.linear's values to a bf16 ulp, each
row the same in any batch (each build: fp32 FMAs at ``avx512``, vdpbf16ps at ``avx512_bf16``),
the widest build the CPU level allows, and models that decode as they do unpacked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import CHUNKS, QUESTION, tiny_model
from test_batch_decode import PROMPTS, greedy, start
from torch import nn

from ragblend import BlendConfig, BlendEngine, cpu
from ragblend.kernels.cpu import dense_decode
from ragblend.kernels.cpu.dense_decode import MAX_ROWS, dense_kernel, tolerance
from ragblend.models import packed as packing

pytestmark = pytest.mark.skipif(
    not cpu.isa_at_least(dense_decode.LEVEL),
    reason=f"the native bf16 kernel needs CPU level avx512; this one is at {cpu.cpu_isa()}",
)

# SmolLM2-135M's proportions, smaller: head_dim 64, 3 query heads per K/V head, tied embeddings
SMOL = dict(hidden_size=192, intermediate_size=512, num_attention_heads=3, num_key_value_heads=1)


@pytest.fixture(scope="module")
def selected() -> dense_decode.DenseKernel:
    """The build the CPU level selects (what packed decoding uses)."""
    built = dense_kernel()
    if built is None:
        pytest.skip("the native bf16 kernel did not build here (no compiler?): see the warning")
    return built


@pytest.fixture(scope="module", params=[b.level for b in dense_decode.BUILDS])
def kernel(request) -> dense_decode.DenseKernel:
    """Each build the CPU has the level for, in turn."""
    level = request.param
    if not cpu.isa_at_least(level):
        pytest.skip(f"the {level} build needs CPU level {level}; this one is at {cpu.cpu_isa()}")
    built = dense_kernel(level)
    if built is None or built.level != level:
        pytest.skip(f"the {level} build did not build or check here: see the warning")
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


def test_the_widest_build_the_cpu_level_allows_is_used(selected):
    allowed = [b.level for b in dense_decode.BUILDS if cpu.isa_at_least(b.level)]
    assert selected.level == allowed[0]


def test_at_the_avx512_cap_the_fp32_build_is_used(selected, monkeypatch):
    monkeypatch.setenv(cpu.ENV_CAP, "avx512")
    capped = dense_kernel()
    assert capped is not None and capped.level == "avx512"
    x, weight, bias = _random(67, 576, 3, seed=5)
    got = capped.matmul(x, weight, bias)
    assert bool(((got.float() - F.linear(x, weight, bias).float()).abs() <= 1).all())


def test_a_failing_wider_build_falls_back_to_the_next_with_one_warning(monkeypatch, caplog):
    checked = dense_decode._check

    def wrong_when_wide(kernel):
        if kernel.level != dense_decode.LEVEL:
            raise RuntimeError("matmul [1, 576] does not match F.linear within a bf16 ulp")
        checked(kernel)

    monkeypatch.setattr(dense_decode, "_BUILT", {})
    monkeypatch.setattr(dense_decode, "_check", wrong_when_wide)
    with caplog.at_level("WARNING", logger=dense_decode.__name__):
        built = dense_kernel()
        assert dense_kernel() is built  # each build tried once
    assert built is not None and built.level == dense_decode.LEVEL
    wide = [b for b in dense_decode.BUILDS[:-1] if cpu.isa_at_least(b.level)]
    warnings = [r for r in caplog.records if r.name == dense_decode.__name__]
    assert len(warnings) == len(wide)
    assert all("does not match" in r.getMessage() for r in warnings)
    assert all("using the next build" in r.getMessage() for r in warnings)


def test_the_avx512_bf16_build_flushes_bf16_subnormals_the_fp32_build_keeps_them(kernel):
    tiny = torch.full((1, 64), 2.0**-130).bfloat16()  # a bf16 (and fp32) subnormal
    assert tiny[0, 0].item() == 2.0**-130
    got = kernel.matmul(tiny, torch.ones(3, 64, dtype=torch.bfloat16), None)
    want = 0.0 if kernel.level == "avx512_bf16" else 64 * 2.0**-130
    assert got.float().tolist() == [[want] * 3]


def test_a_packed_bf16_model_decodes_the_tokens_it_decodes_unpacked(selected, tokenizer):
    def answer(packed: bool) -> list[int]:
        model = tiny_model("llama", dtype=torch.bfloat16, **SMOL)
        engine = BlendEngine(model, tokenizer, BlendConfig(packed_decode=packed))
        ids = engine.generate(QUESTION, CHUNKS, mode="full", max_new_tokens=8).token_ids
        assert packing.is_packed(model) == packed
        return ids

    packed = answer(True)
    assert len(packed) == 8 and packed == answer(False)


def test_each_requests_logits_in_a_packed_bf16_batch_equal_its_logits_alone(selected, tokenizer):
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
