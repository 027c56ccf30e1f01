"""8-bit decode activations (``decode_activations="int8"``): the kernels equal the integer
reference per weight type, rows are the same alone and batched, only int8 decode steps take
them, ``auto`` follows its table, and where they cannot run decoding stays exact with a warning."""

from __future__ import annotations

import logging

import pytest
import torch

from ragblend import cpu
from ragblend.kernels.cpu import int8_decode, int8_reference
from ragblend.kernels.cpu.int8_decode import (
    AUTO_BY_LEVEL,
    int8_kernels,
    resolve_decode_activations,
    step_activations,
)
from ragblend.kernels.cpu.quant_kernels import (
    QUANT_TYPES,
    dequantize_reference,
    quant_kernels,
    random_blocks,
)
from ragblend.models.quantized import (
    QuantizedWeight,
    QuantLinear,
    decode_activations_for,
    fused_matmul,
)

needs_kernels = pytest.mark.skipif(
    not cpu.isa_at_least(int8_decode.LEVEL), reason="the int8 kernels need AVX2"
)


def _x(n: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, cols, generator=gen) * torch.rand(n, 1, generator=gen) * 4


@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_the_reference_unpacks_every_type_to_ggufs_values(qtype):
    blocks = random_blocks(6, 512, qtype, torch.Generator().manual_seed(qtype))
    weight = int8_reference.integer_weight(blocks, qtype, 512)
    assert torch.equal(int8_reference.dequantized(weight), dequantize_reference(blocks, qtype, 512))


def test_the_reference_quantizes_as_llama_cpp():
    x = torch.tensor([[0.0] * 31 + [2.54] + [0.5] * 32])
    x[0, 40] = -0.25
    q = int8_reference.quantize_rows(x, 32)
    d = torch.tensor(2.54) / 127  # amax / 127 in float32, then kept as float16
    assert q.d[0, 0] == d.half().float()
    assert q.q[0, 31] == 127 and q.q[0, 0] == 0
    inverse = 1.0 / (torch.tensor(0.5) / 127)  # codes: round(x * (1 / d)), d not rounded
    assert q.q[0, 40] == torch.round(torch.tensor(-0.25) * inverse)
    assert torch.equal(q.sums16[0], q.q[0].long().reshape(4, 16).sum(-1))
    k = int8_reference.quantize_rows(torch.zeros(1, 256), 256)
    assert k.d[0, 0] == 0 and not k.q.any()  # a block of zeros: d 0, codes 0


@needs_kernels
@pytest.mark.parametrize("block", [32, 256])
def test_the_kernels_quantize_x_bit_for_bit_as_the_reference(block):
    kernels = int8_kernels()
    assert kernels is not None
    x = _x(9, 1024, block)
    x[2, :256] = 0.0
    q, d, sums = kernels.quantize(x, block)
    want = int8_reference.quantize_rows(x, block)
    assert torch.equal(q, want.q) and torch.equal(d, want.d)
    assert torch.equal(sums.long(), want.sums16)


@needs_kernels
@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_int8_matmul_equals_the_integer_reference_and_not_the_float_path(qtype):
    kernels = int8_kernels()
    assert kernels is not None
    blocks = random_blocks(70, 1024, qtype, torch.Generator().manual_seed(qtype + 1))
    x, bias = _x(5, 1024, qtype), torch.randn(70)
    got = kernels.matmul(x, blocks, qtype, 1024, bias)
    want = int8_reference.matmul_reference(x, blocks, qtype, 1024, bias)
    bound = int8_reference.term_bound(x, blocks, qtype, 1024, bias)
    assert bool(((got - want).abs() <= bound).all())
    dense = x @ dequantize_reference(blocks, qtype, 1024).T + bias  # what "float" computes
    assert bool(((dense - want).abs() > bound).any())  # the bound tells the two apart
    # and int8 stays near it: 8-bit activations cost ~1% of the output's scale here
    assert (got - dense).abs().max() <= 0.05 * dense.abs().max()


@needs_kernels
@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_int8_matmul_row_is_the_same_alone_and_batched(qtype):
    kernels = int8_kernels()
    assert kernels is not None
    blocks = random_blocks(40, 512, qtype, torch.Generator().manual_seed(qtype + 2))
    x = _x(16, 512, qtype + 3)
    batched = kernels.matmul(x, blocks, qtype, 512, None)
    for n in (1, 3, 8):
        assert torch.equal(kernels.matmul(x[:n], blocks, qtype, 512, None), batched[:n])
    assert torch.equal(kernels.matmul(x[11:12], blocks, qtype, 512, None)[0], batched[11])


@needs_kernels
def test_int8_matmul_cat_is_each_weights_matmul_side_by_side():
    kernels = int8_kernels()
    assert kernels is not None
    gen = torch.Generator().manual_seed(5)
    qtypes = [2, 14, 7, 12]
    parts = [random_blocks(r, 512, q, gen) for r, q in zip((33, 8, 65, 1), qtypes)]
    biases = [None, torch.randn(8), None, torch.randn(1)]
    x = _x(4, 512, 6)
    alone = [kernels.matmul(x, b, q, 512, c) for b, q, c in zip(parts, qtypes, biases)]
    assert torch.equal(kernels.matmul_cat(x, parts, qtypes, 512, biases), torch.cat(alone, 1))


@needs_kernels
@pytest.mark.parametrize(
    "call, message",
    [
        (lambda k, b: k.matmul(torch.randn(17, 512), b, 12, 512, None), "rows"),
        (lambda k, b: k.matmul(torch.randn(1, 512).double(), b, 12, 512, None), "float32"),
        (lambda k, b: k.matmul(torch.randn(1, 512), b, 12, 256, None), "columns"),
        (lambda k, b: k.matmul(torch.randn(1, 512), b, 9, 512, None), "unsupported ggml type"),
        (lambda k, b: k.matmul(torch.randn(1, 512), b[:, :10], 12, 512, None), "blocks"),
    ],
)
def test_bad_input_is_a_clear_error(call, message):
    kernels = int8_kernels()
    assert kernels is not None
    blocks = random_blocks(4, 512, 12, torch.Generator().manual_seed(0))
    with pytest.raises(RuntimeError, match=message):
        call(kernels, blocks)


AMX_BUILD, VNNI_BUILD, AVX2_BUILD = int8_decode.BUILDS
needs_vnni = pytest.mark.skipif(
    not int8_decode.runs_here(VNNI_BUILD),
    reason="the VNNI build needs AVX512 with AVX512-VNNI",
)
needs_amx = pytest.mark.skipif(
    not int8_decode.runs_here(AMX_BUILD),
    reason="the AMX build needs AMX-INT8 and AVX512-VNNI",
)
TILED = (3, 8)  # the types the AMX build takes to its tiles: Q4_1, Q8_0


@needs_vnni
@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_the_vnni_build_gives_the_avx2_builds_floats_bit_for_bit(qtype):
    vnni, avx2 = (int8_decode.kernels_of(b.name) for b in (VNNI_BUILD, AVX2_BUILD))
    assert (vnni.build, avx2.build) == ("ragblend_q8vnni", "ragblend_q8")
    blocks = random_blocks(97, 1024, qtype, torch.Generator().manual_seed(qtype + 7))
    bias = torch.randn(97)
    for n in (1, 4, 7, 16):
        x = _x(n, 1024, qtype + n)
        got = vnni.matmul(x, blocks, qtype, 1024, bias)
        assert torch.equal(got, avx2.matmul(x, blocks, qtype, 1024, bias))
        want = int8_reference.matmul_reference(x, blocks, qtype, 1024, bias)
        bound = int8_reference.term_bound(x, blocks, qtype, 1024, bias)
        assert bool(((got - want).abs() <= bound).all())


@needs_amx
@pytest.mark.parametrize("qtype", list(QUANT_TYPES))
def test_the_amx_build_is_the_integer_reference_and_each_row_the_same_alone(qtype):
    """Q4_1 and Q8_0 run on AMX-INT8 tiles (their per-block terms in another float32 order:
    within the reference's bound, not the VNNI build's bits); the other types, the VNNI code."""
    amx, vnni = (int8_decode.kernels_of(b.name) for b in (AMX_BUILD, VNNI_BUILD))
    blocks = random_blocks(97, 1024, qtype, torch.Generator().manual_seed(qtype + 11))
    bias = torch.randn(97)  # 97 rows: 6 groups of 16 and one of 1
    x = _x(16, 1024, qtype + 3)
    batched = amx.matmul(x, blocks, qtype, 1024, bias)
    want = int8_reference.matmul_reference(x, blocks, qtype, 1024, bias)
    bound = int8_reference.term_bound(x, blocks, qtype, 1024, bias)
    assert bool(((batched - want).abs() <= bound).all())
    for n in (1, 4, 7):
        assert torch.equal(amx.matmul(x[:n], blocks, qtype, 1024, bias), batched[:n])
    assert torch.equal(amx.matmul(x[9:10], blocks, qtype, 1024, bias)[0], batched[9])
    same = torch.equal(batched, vnni.matmul(x, blocks, qtype, 1024, bias))
    assert same == (qtype not in TILED)


@needs_amx
def test_the_amx_build_tiles_each_weight_of_a_concatenation():
    amx = int8_decode.kernels_of(AMX_BUILD.name)
    gen = torch.Generator().manual_seed(5)
    parts = [random_blocks(rows, 512, q, gen) for rows, q in ((40, 3), (24, 8), (33, 12))]
    biases = [torch.randn(p.shape[0], generator=gen) for p in parts]
    x = _x(5, 512, 2)
    alone = [amx.matmul(x, p, q, 512, b) for p, q, b in zip(parts, (3, 8, 12), biases)]
    assert torch.equal(amx.matmul_cat(x, parts, [3, 8, 12], 512, biases), torch.cat(alone, 1))


def test_the_amx_build_needs_amx_int8_and_vnni(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_isa", lambda: "amx")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_vnni"}))
    assert not int8_decode.runs_here(AMX_BUILD)  # AMX-BF16 only (a cap, or no AMX-INT8)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_vnni", "amx_int8"}))
    assert int8_decode.runs_here(AMX_BUILD)
    monkeypatch.setattr(cpu, "cpu_isa", lambda: "avx512_bf16")  # RAGBLEND_CPU_ISA caps it
    assert not int8_decode.runs_here(AMX_BUILD) and int8_decode.runs_here(VNNI_BUILD)


@needs_vnni
def test_the_widest_build_this_cpu_runs_is_the_one_taken(monkeypatch):
    kernels = int8_kernels()
    widest = AMX_BUILD if int8_decode.runs_here(AMX_BUILD) else VNNI_BUILD
    assert kernels is not None and kernels.build == widest.name
    monkeypatch.setattr(cpu, "cpu_isa", lambda: "avx2")  # RAGBLEND_CPU_ISA=avx2
    assert not int8_decode.runs_here(AMX_BUILD) and not int8_decode.runs_here(VNNI_BUILD)
    assert int8_decode.runs_here(AVX2_BUILD)
    monkeypatch.setattr(int8_decode, "_BUILT", None)
    capped = int8_kernels()
    assert capped is not None and capped.build == "ragblend_q8"


def test_the_vnni_build_needs_avx512_and_its_vnni_flag(monkeypatch):
    vnni = VNNI_BUILD
    monkeypatch.setattr(cpu, "cpu_isa", lambda: "amx")
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f"}))  # Skylake-SP
    assert not int8_decode.runs_here(vnni)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx512f", "avx512_vnni"}))
    assert int8_decode.runs_here(vnni)
    monkeypatch.setattr(cpu, "cpu_isa", lambda: "avx2")
    assert not int8_decode.runs_here(vnni)
    with pytest.raises(ValueError, match="does not run"):
        int8_decode.kernels_of(vnni.name)
    with pytest.raises(ValueError, match="no int8 kernel build"):
        int8_decode.kernels_of("ragblend_q4")


@needs_vnni
def test_a_wide_build_that_fails_its_check_leaves_the_next_build_with_one_warning(
    monkeypatch, caplog
):
    check = int8_decode.check
    runnable = [b.name for b in int8_decode.BUILDS if int8_decode.runs_here(b)]

    def failing(kernels):
        if kernels.build == runnable[0]:
            raise RuntimeError("Q4_K int8 matmul does not match the integer reference")
        check(kernels)

    monkeypatch.setattr(int8_decode, "_BUILT", None)
    monkeypatch.setattr(int8_decode, "check", failing)
    with caplog.at_level(logging.WARNING, logger="ragblend.kernels.cpu.int8_decode"):
        kernels = int8_kernels()
        assert int8_kernels() is kernels
    assert kernels is not None and kernels.build == runnable[1]
    warnings = [r.message for r in caplog.records]
    assert len(warnings) == 1 and runnable[0] in warnings[0] and "Q4_K" in warnings[0]


def test_a_kernel_off_the_reference_fails_the_check():
    """The load-time check is not vacuous: the exact float kernel, put in the int8 kernel's
    place, fails it."""
    exact = quant_kernels()
    if exact is None or not cpu.isa_at_least(int8_decode.LEVEL):
        pytest.skip("needs the quantized kernels")
    kernels = int8_kernels()
    assert kernels is not None
    wrong = kernels._replace(matmul=exact.matmul)
    with pytest.raises(RuntimeError, match="does not match the integer reference"):
        int8_decode.check(wrong)


@pytest.mark.parametrize("level", list(AUTO_BY_LEVEL))
def test_auto_follows_its_table_at_every_level(monkeypatch, level):
    monkeypatch.setattr(cpu, "cpu_isa", lambda: level)
    assert resolve_decode_activations("auto") == AUTO_BY_LEVEL[level].mode
    assert (
        resolve_decode_activations("float") == "float"
        and resolve_decode_activations("int8") == "int8"
    )
    assert AUTO_BY_LEVEL[level].measured  # where the choice comes from is said


def test_an_unknown_setting_is_a_clear_error():
    from ragblend import BlendConfig
    from ragblend.errors import RagblendError

    with pytest.raises(RagblendError, match="decode_activations"):
        BlendConfig(decode_activations="int4")  # type: ignore[arg-type]
    with pytest.raises(RagblendError, match="decode_activations"):
        resolve_decode_activations("int4")


def _linear(qtype: int = 12, rows: int = 48, cols: int = 512) -> QuantLinear:
    blocks = random_blocks(rows, cols, qtype, torch.Generator().manual_seed(rows))
    return QuantLinear(QuantizedWeight(blocks, qtype, cols), torch.randn(rows), torch.float32)


@needs_kernels
def test_only_an_int8_decode_step_takes_the_int8_kernels():
    layer = _linear()
    kernels = int8_kernels()
    assert kernels is not None
    x = _x(3, 512, 9).view(1, 3, 512)
    exact = layer.qweight.matmul(x[0], layer.bias)
    int8 = kernels.matmul(x[0], layer.qweight.blocks, 12, 512, layer.bias.detach())
    with torch.inference_mode():
        assert torch.equal(layer(x)[0], exact)  # outside a decode step
        with step_activations("float"):
            assert torch.equal(layer(x)[0], exact)
        with step_activations("int8"):
            assert torch.equal(layer(x)[0], int8)
            long = _x(20, 512, 10)  # more rows than a decode step: the prefill's F.linear
            dense = torch.nn.functional.linear(long, layer.qweight.dequantize(torch.float32))
            assert torch.allclose(layer(long), dense + layer.bias, atol=1e-4)
        assert torch.equal(layer(x)[0], exact)  # the step's end restores the exact path


@needs_kernels
def test_fused_projections_take_the_int8_kernels_in_an_int8_step():
    layers = [_linear(12, 48), _linear(14, 16), _linear(8, 16)]
    call = fused_matmul(layers)
    assert call is not None
    x = _x(2, 512, 11)
    with torch.inference_mode(), step_activations("int8"):
        fused = call(x)
        alone = [layer(x) for layer in layers]
    for got, want in zip(fused, alone):
        assert torch.equal(got, want)
    with torch.inference_mode():
        assert not torch.equal(call(x)[0], fused[0])  # outside: the exact kernel


def test_where_the_kernels_cannot_run_int8_decodes_in_float_with_a_warning(monkeypatch, caplog):
    from torch import nn

    monkeypatch.setattr(int8_decode, "_BUILT", None)
    monkeypatch.setattr(cpu, "cpu_isa", lambda: "baseline")
    monkeypatch.setattr(cpu, "isa_at_least", lambda level: False)
    model = nn.Sequential(_linear())
    with caplog.at_level(logging.WARNING, logger="ragblend.kernels.cpu.int8_decode"):
        assert decode_activations_for(model, "int8") == "float"
        assert decode_activations_for(model, "int8") == "float"
    assert sum("8-bit decode activations are off" in r.message for r in caplog.records) == 1
    assert decode_activations_for(model, "auto") == "float"  # baseline: float
    assert decode_activations_for(nn.Linear(4, 4), "int8") == "float"  # dense


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    """A tiny Llama GGUF with every kernel type on some matrix (test_quantized_model's mix)."""
    from conftest import tiny_model
    from gguf_files import write_gguf
    from test_quantized_model import MIX, SIZES

    monkeypatch.setenv("RAGBLEND_HOME", str(tmp_path / "home"))
    return write_gguf(tiny_model("llama", **SIZES), "llama", tmp_path / "llama.gguf", quant=MIX)


@needs_kernels
def test_an_int8_engine_decodes_near_float_and_prefills_exactly(tiny_gguf):
    from conftest import CHUNKS, QUESTION

    from ragblend import BlendConfig, BlendEngine
    from ragblend.decode.decoder import decode_batch
    from ragblend.errors import RagblendError

    engine = BlendEngine.from_pretrained(
        str(tiny_gguf), config=BlendConfig(dtype="float32", decode_activations="int8")
    )
    exact = engine.with_config(decode_activations="float")
    for view in (engine, exact):
        view.prepare_decode()
    assert (engine.decode_activations, exact.decode_activations) == ("int8", "float")
    assert engine.decode_path.endswith("-int8") and exact.decode_path.endswith("-native")
    prompts = [engine.tokenize(QUESTION, CHUNKS[:n]).ids for n in (1, 2, 3)]
    prefills = [engine.full_prefill(ids) for ids in prompts]
    again = exact.full_prefill(prompts[0])
    assert torch.equal(prefills[0].logits, again.logits)  # prefill: the exact path either way
    tokens = [int(p.logits.argmax()) for p in prefills]
    int8 = [engine.decoder(p, 4) for p in prefills]
    batched = decode_batch(int8, tokens)
    for i, prefill in enumerate(prefills):
        alone = engine.decoder(prefill, 4).step(tokens[i])
        assert torch.equal(alone, batched[i])  # a request's int8 step: the same in a batch
        floats = exact.decoder(prefill, 4).step(tokens[i])
        assert not torch.equal(alone, floats)
        kl = torch.nn.functional.kl_div(
            alone.log_softmax(-1), floats.log_softmax(-1), log_target=True, reduction="sum"
        )
        assert float(kl) < 0.05  # random tiny weights: a loose bound; measured on real ones
    with pytest.raises(RagblendError, match="decode_activations"):
        decode_batch([int8[0], exact.decoder(prefills[1], 4)], tokens[:2])
    result = engine.generate(QUESTION, CHUNKS, max_new_tokens=3)
    assert result.token_ids
