"""The native kernels on GGUF quantized blocks: dequantize equals the gguf package bit for bit,
matmul equals ``x @ dequantized.T (+ bias)`` to float32 rounding (bf16 x in the
``avx512_bf16`` build: ``F.linear`` on the weights rounded to bf16 within the dense bf16
kernel's tolerance), a row's matmul output is the same alone and in a batch, and bad input is
a clear error.

Oracle: ``gguf.dequantize`` (numpy) on the same blocks (:func:`dequantize_reference`). The
matmul tolerance is :func:`matmul_tolerance`: 1e-4 of ``|x| @ |W|.T`` plus 1e-6 per output,
well above float32 rounding of a 4096-long dot product and far below any wrong weight.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ragblend.kernels.cpu.dense_decode import tolerance
from ragblend.kernels.cpu.quant_kernels import (
    MAX_ROWS,
    QUANT_TYPES,
    SCALE_FIELDS,
    QuantKernels,
    block_shape,
    dequantize_reference,
    kernels_in_use,
    kernels_of,
    matmul_tolerance,
    quant_kernels,
    random_blocks,
)

KERNELS = quant_kernels()
pytestmark = pytest.mark.skipif(
    KERNELS is None, reason="the quantized-weight kernels need the avx2 CPU level and a compiler"
)
TYPES = sorted(QUANT_TYPES)
K_TYPES = {12, 13, 14}


def _kernels() -> QuantKernels:
    assert KERNELS is not None
    return KERNELS


def _widths(qtype: int) -> list[int]:
    return [256, 512, 4096] if qtype in K_TYPES else [96, 256, 512, 4096]


def _case(qtype: int, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + qtype)
    blocks = random_blocks(rows, cols, qtype, gen)
    return blocks, dequantize_reference(blocks, qtype, cols)


@pytest.mark.parametrize("qtype", TYPES, ids=[QUANT_TYPES[t] for t in TYPES])
def test_dequantize_equals_gguf_bit_for_bit(qtype):
    for cols in _widths(qtype):
        blocks, ref = _case(qtype, 37, cols)
        got = _kernels().dequantize(blocks, qtype, cols, torch.float32)
        assert got.shape == (37, cols) and got.dtype == torch.float32
        assert torch.equal(got, ref), f"{QUANT_TYPES[qtype]} cols={cols}"
        assert ref.abs().max() > 0  # the blocks are not all zero weights


@pytest.mark.parametrize("qtype", TYPES, ids=[QUANT_TYPES[t] for t in TYPES])
def test_dequantize_is_exact_for_any_finite_f16_scale(qtype):
    # every scale field a random finite f16 bit pattern: zeros, subnormals, up to 65504
    blocks, _ = _case(qtype, 64, 512, seed=5)
    elems, size = block_shape(qtype)
    view = blocks.view(64, 512 // elems, size)
    gen = torch.Generator().manual_seed(qtype)
    for offset in SCALE_FIELDS[qtype]:
        bits = torch.randint(0, 1 << 16, view.shape[:2], generator=gen, dtype=torch.int32)
        bits = torch.where((bits >> 10) & 0x1F == 0x1F, bits & 0x83FF, bits)  # no inf / NaN
        view[:, :, offset : offset + 2] = bits.to(torch.int16).view(torch.uint8).view(64, -1, 2)
    ref = dequantize_reference(blocks, qtype, 512)
    assert bool(ref.isfinite().all())
    assert torch.equal(_kernels().dequantize(blocks, qtype, 512, torch.float32), ref)


def test_the_embedded_gguf_tensors_match_gguf():
    import gguf

    from ragblend.errors import RagblendError
    from ragblend.models.loading import embedded_gguf_path

    try:
        reader = gguf.GGUFReader(embedded_gguf_path())
    except RagblendError as exc:
        pytest.skip(str(exc))
    seen = set()
    for tensor in reader.tensors:
        qtype = int(tensor.tensor_type)
        if qtype not in QUANT_TYPES or (qtype, tensor.data.shape) in seen:
            continue
        seen.add((qtype, tensor.data.shape))
        blocks = torch.from_numpy(tensor.data[:1024].copy())  # [rows, row_bytes] as stored
        cols = gguf.quant_shape_from_byte_shape(tensor.data.shape, tensor.tensor_type)[-1]
        ref = dequantize_reference(blocks, qtype, cols)
        assert torch.equal(_kernels().dequantize(blocks, qtype, cols, torch.float32), ref)
        x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0))
        got = _kernels().matmul(x, blocks, qtype, cols, None)
        assert bool(((got - x @ ref.T).abs() <= matmul_tolerance(x, ref)).all()), tensor.name
    assert {int(gguf.GGMLQuantizationType.Q4_1), int(gguf.GGMLQuantizationType.Q8_0)} <= {
        q for q, _ in seen
    }


@pytest.mark.parametrize("qtype", TYPES, ids=[QUANT_TYPES[t] for t in TYPES])
def test_bf16_dequantize_is_the_float32_values_rounded(qtype):
    blocks, ref = _case(qtype, 19, 512, seed=1)
    got = _kernels().dequantize(blocks, qtype, 512, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (19, 512)
    assert torch.equal(got, ref.to(torch.bfloat16))


def test_bf16_rounding_is_to_nearest_even_on_ties():
    # Q8_0 with d = 1 and q = 1..127 gives exact small integers; d = 1 + 2^-8 puts products on
    # bf16 ties (bf16 keeps 8 significant bits), where rounding goes to the even neighbour
    blocks = torch.zeros(1, 34, dtype=torch.uint8)
    blocks[0, :2] = torch.tensor([1 + 2**-8], dtype=torch.float16).view(torch.uint8)
    blocks[0, 2:] = torch.arange(1, 33, dtype=torch.uint8) * 3
    ref = dequantize_reference(blocks, 8, 32)
    got = _kernels().dequantize(blocks, 8, 32, torch.bfloat16)
    assert torch.equal(got, ref.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", TYPES, ids=[QUANT_TYPES[t] for t in TYPES])
def test_matmul_equals_x_times_dequantized_weights(qtype):
    cols = 4096 if qtype in K_TYPES else 1024
    blocks, ref = _case(qtype, 45, cols, seed=2)
    gen = torch.Generator().manual_seed(qtype)
    bias = torch.randn(45, generator=gen)
    for n in range(1, MAX_ROWS + 1):
        x = torch.randn(n, cols, generator=gen)
        with_bias = n % 2 == 0
        got = _kernels().matmul(x, blocks, qtype, cols, bias if with_bias else None)
        want = x @ ref.T + (bias if with_bias else 0)
        assert got.shape == (n, 45) and got.dtype == torch.float32
        assert bool(((got - want).abs() <= matmul_tolerance(x, ref)).all()), f"n={n}"


@pytest.mark.skipif(
    KERNELS is not None and KERNELS.bf16_products,
    reason="the avx512_bf16 build multiplies bf16 weights (test_bf16_products_matmul_...)",
)
@pytest.mark.parametrize("qtype", TYPES, ids=[QUANT_TYPES[t] for t in TYPES])
def test_bf16_matmul_is_the_float32_matmul_rounded_to_bf16(qtype):
    cols = 512 if qtype in K_TYPES else 96 * 3
    blocks, _ = _case(qtype, 37, cols, seed=5)
    gen = torch.Generator().manual_seed(qtype + 100)
    x = torch.randn(MAX_ROWS, cols, generator=gen).bfloat16()
    bias = torch.randn(37, generator=gen).bfloat16()
    for n in (1, 4, MAX_ROWS):
        for b in (None, bias, bias.float()):
            got = _kernels().matmul(x[:n].contiguous(), blocks, qtype, cols, b)
            fb = None if b is None else b.float()
            want = _kernels().matmul(x[:n].float(), blocks, qtype, cols, fb).bfloat16()
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), f"n={n}"
    one = _kernels().matmul(x[5:6].contiguous(), blocks, qtype, cols, bias)
    assert torch.equal(one[0], _kernels().matmul(x, blocks, qtype, cols, bias)[5])


@pytest.mark.skipif(
    KERNELS is None or not KERNELS.bf16_products, reason="only the avx512_bf16 build"
)
@pytest.mark.parametrize("qtype", TYPES, ids=[QUANT_TYPES[t] for t in TYPES])
def test_bf16_products_matmul_is_f_linear_on_the_weights_rounded_to_bf16(qtype):
    # widths whose blocks in a group of 1024 columns are not a multiple of the 2 or 4 a tile
    # takes per step (9, 7 blocks), and two groups
    for cols in [512, 1280] if qtype in K_TYPES else [96 * 3, 224, 1056]:
        blocks, _ = _case(qtype, 37, cols, seed=6)
        weight = _kernels().dequantize(blocks, qtype, cols, torch.bfloat16)
        gen = torch.Generator().manual_seed(qtype + 200)
        x = torch.randn(MAX_ROWS, cols, generator=gen).bfloat16()
        bias = torch.randn(37, generator=gen).bfloat16()
        batched = _kernels().matmul(x, blocks, qtype, cols, bias)
        for n in (1, 3, 8, MAX_ROWS):
            for b in (None, bias):
                got = _kernels().matmul(x[:n].contiguous(), blocks, qtype, cols, b)
                want = F.linear(x[:n], weight, b)
                bound = tolerance(x[:n], weight, got, want)
                assert got.dtype == torch.bfloat16, f"n={n}"
                assert bool(((got.float() - want.float()).abs() <= bound).all()), f"n={n}"
        for i in range(MAX_ROWS):
            alone = _kernels().matmul(x[i : i + 1].contiguous(), blocks, qtype, cols, bias)
            assert torch.equal(alone[0], batched[i]), f"row {i}"


@pytest.mark.parametrize("qtype", TYPES, ids=[QUANT_TYPES[t] for t in TYPES])
@pytest.mark.parametrize("rows", [1, 33, 67, 130])
def test_matmul_row_is_the_same_alone_and_batched(qtype, rows):
    cols = 512 if qtype in K_TYPES else 96 * (1 + rows % 3)
    blocks, _ = _case(qtype, rows, cols, seed=3)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(MAX_ROWS, cols, generator=gen)
    bias = torch.randn(rows, generator=gen)
    batched = _kernels().matmul(x, blocks, qtype, cols, bias)
    for i in range(MAX_ROWS):
        alone = _kernels().matmul(x[i : i + 1].clone(), blocks, qtype, cols, bias)
        assert torch.equal(alone[0], batched[i]), f"row {i}"
    middle = _kernels().matmul(x[3:10].contiguous(), blocks, qtype, cols, bias)
    assert torch.equal(middle, batched[3:10])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_outputs_are_the_same_alone_and_batched(dtype):
    # inf in x makes outputs of +-inf and NaN (inf - inf: the CPU's NaN is negative); a batch
    # sums a tile's outputs together, a lone row one by one: both round them alike (bf16 NaN
    # as c10::BFloat16's 0x7FC0)
    blocks, _ = _case(8, 40, 256, seed=7)
    x = torch.randn(MAX_ROWS, 256, generator=torch.Generator().manual_seed(7))
    x[2, 5] = float("inf")
    x[9, :] = float("inf")
    x[12, 3] = float("nan")
    x = x.to(dtype)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    batched = _kernels().matmul(x, blocks, 8, 256, None)
    assert bool(batched[9].isnan().any()) and bool(batched[12].isnan().all())
    for i in range(MAX_ROWS):
        alone = _kernels().matmul(x[i : i + 1].contiguous(), blocks, 8, 256, None)
        assert torch.equal(alone[0].view(bits), batched[i].view(bits)), f"row {i}"
    if dtype == torch.bfloat16:
        assert bool((batched[12].view(torch.int16) == 0x7FC0).all())


def test_matmul_row_does_not_depend_on_the_thread_count():
    blocks, _ = _case(12, 200, 1024, seed=4)
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _kernels().matmul(x, blocks, 12, 1024, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(_kernels().matmul(x, blocks, 12, 1024, None), one)


def test_a_build_can_be_put_in_use_for_a_block_and_is_restored_after():
    kernels = _kernels()
    again = kernels_of(kernels.level)  # the same build, loaded and checked again
    assert again.level == kernels.level and again.bf16_products == kernels.bf16_products
    with kernels_in_use(again):
        assert quant_kernels() is again
    assert quant_kernels() is kernels
    with pytest.raises(ValueError, match="no quantized-kernel build"):
        kernels_of("avx1024")


def test_empty_weights_give_empty_outputs():
    blocks = torch.empty(0, 144, dtype=torch.uint8)
    assert _kernels().dequantize(blocks, 12, 256, torch.float32).shape == (0, 256)
    assert _kernels().matmul(torch.ones(2, 256), blocks, 12, 256, None).shape == (2, 0)


def _short(blocks: torch.Tensor) -> torch.Tensor:
    """The first half of each row of ``blocks``: rows too short for their columns."""
    return blocks[:, : blocks.shape[1] // 2].contiguous()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda k, b, x: k.matmul(x.double(), b, 12, 512, None), "float32"),
        (lambda k, b, x: k.matmul(torch.ones(MAX_ROWS + 1, 512), b, 12, 512, None), "rows"),
        (lambda k, b, x: k.matmul(torch.ones(0, 512), b, 12, 512, None), "rows"),
        (lambda k, b, x: k.matmul(x[:, :256].contiguous(), b, 12, 256, None), "bytes"),
        (lambda k, b, x: k.matmul(torch.ones(1, 500), b, 12, 500, None), "multiple"),
        (lambda k, b, x: k.matmul(x, b, 12, 512, torch.ones(5)), "bias"),
        (lambda k, b, x: k.matmul(x, b, 12, 256, None), "columns"),
        (lambda k, b, x: k.matmul(x, b, 5, 512, None), "unsupported"),
        (lambda k, b, x: k.matmul(x.t(), b, 12, 512, None), "contiguous"),
        (lambda k, b, x: k.matmul_cat(x, [b, b], [12], 512, [None, None]), "one qtype"),
        (lambda k, b, x: k.matmul_cat(x, [], [], 512, []), "at least one"),
        (lambda k, b, x: k.matmul_cat(x, [b, _short(b)], [12] * 2, 512, [None] * 2), "bytes"),
        (lambda k, b, x: k.dequantize(b.float(), 12, 512, torch.float32), "uint8"),
        (lambda k, b, x: k.dequantize(b[:, :200], 12, 512, torch.float32), "contiguous"),
        (lambda k, b, x: k.dequantize(b[:, :144].contiguous(), 12, 512, torch.float32), "bytes"),
        (lambda k, b, x: k.dequantize(b, 12, 480, torch.float32), "multiple"),
        (lambda k, b, x: k.dequantize(b, 12, 512, torch.float16), "dtype"),
        (lambda k, b, x: k.dequantize(b.view(-1), 12, 512, torch.float32), "2-D"),
    ],
)
def test_bad_input_is_a_clear_error(call, message):
    blocks, _ = _case(12, 4, 512)
    x = torch.ones(4, 512)
    with pytest.raises(RuntimeError, match=message):
        call(_kernels(), blocks, x)


def test_random_blocks_have_finite_scales_of_the_asked_size():
    for qtype in TYPES:
        elems, size = block_shape(qtype)
        blocks = random_blocks(3, elems * 2, qtype, torch.Generator().manual_seed(0))
        assert blocks.shape == (3, 2 * size) and blocks.dtype == torch.uint8
        assert bool(dequantize_reference(blocks, qtype, elems * 2).isfinite().all())
    with pytest.raises(ValueError):
        random_blocks(1, 100, 12, torch.Generator())


def test_below_avx2_there_are_no_kernels_and_one_warning(monkeypatch, caplog):
    from ragblend.kernels.cpu import quant_kernels as module

    monkeypatch.setattr(module, "_BUILT", None)
    monkeypatch.setenv("RAGBLEND_CPU_ISA", "baseline")
    with caplog.at_level("WARNING", logger=module.__name__):
        assert module.quant_kernels() is None
        assert module.quant_kernels() is None
    warnings = [r for r in caplog.records if r.name == module.__name__]
    assert len(warnings) == 1 and "avx2" in warnings[0].getMessage()


def test_a_failing_check_turns_the_kernels_off(monkeypatch, caplog):
    from ragblend.kernels.cpu import quant_kernels as module

    def wrong(kernels, qtype):
        raise RuntimeError(f"{QUANT_TYPES[qtype]} dequantize does not match gguf's bit for bit")

    monkeypatch.setattr(module, "_BUILT", None)
    monkeypatch.setattr(module, "_check", wrong)
    with caplog.at_level("WARNING", logger=module.__name__):
        assert module.quant_kernels() is None
    assert "does not match" in caplog.text


def test_the_widest_build_the_cpu_level_allows_is_used():
    from ragblend import cpu
    from ragblend.kernels.cpu.quant_kernels import BUILDS

    allowed = [b.level for b in BUILDS if cpu.isa_at_least(b.level)]
    assert _kernels().level == allowed[0]


def test_a_failing_wider_build_falls_back_to_the_next_with_one_warning(monkeypatch, caplog):
    from ragblend.kernels.cpu import quant_kernels as module

    checked = module._check

    def wrong_when_wide(kernels, qtype):
        if kernels.level != module.LEVEL:
            raise RuntimeError(f"{QUANT_TYPES[qtype]} matmul does not match x @ dequantize(w).T")
        checked(kernels, qtype)

    monkeypatch.setattr(module, "_BUILT", None)
    monkeypatch.setattr(module, "_check", wrong_when_wide)
    with caplog.at_level("WARNING", logger=module.__name__):
        kernels = module.quant_kernels()
    assert kernels is not None and kernels.level == module.LEVEL
    wide = [b for b in module.BUILDS[:-1] if module.cpu.isa_at_least(b.level)]
    warnings = [r for r in caplog.records if r.name == module.__name__]
    assert len(warnings) == len(wide)
    assert all("using the next build" in r.getMessage() for r in warnings)
