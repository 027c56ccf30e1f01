"""The decode step's attention kernels, each build against SDPA in fp32 over the same values:
fp32 math to fp32 rounding (atol 1e-5, rtol 1e-4), the bf16 dot-product build to bf16
rounding of its probabilities (atol = rtol = 2e-2); K/V written at each position; a request's
output batched equal to its output alone, bit for bit."""

from __future__ import annotations

import pytest
import torch

from ragblend import cpu
from ragblend.errors import RagblendError
from ragblend.kernels.cpu import decode_kernels
from ragblend.kernels.cpu.native import build_kernels, cpu_runs_kernel, decode_builds

# (query heads, KV heads, head dim), and key counts either side of the 16-key tiles, the
# 32-value runs and the 512-key blocks
SHAPES = [(14, 2, 64), (9, 3, 64), (4, 2, 128), (4, 1, 96), (2, 2, 32)]
LENGTHS = [[0], [1], [15], [16], [17], [33], [511], [512], [513], [1100, 40, 600]]


BUILDS = [(name, kernel, dtype) for name, (kernel, dtype) in decode_builds().items()]
IDS = [name for name, _, _ in BUILDS]


def _case(shape, lengths, dtype, seed):
    heads, kv_heads, dim = shape
    gen = torch.Generator().manual_seed(seed)
    batch = len(lengths)
    q = torch.randn(1, heads, batch, dim, generator=gen).to(dtype)
    k_new, v_new = torch.randn(2, 1, kv_heads, batch, dim, generator=gen).to(dtype)
    keys = [torch.randn(1, kv_heads, n + 3, dim, generator=gen).to(dtype) for n in lengths]
    values = [torch.randn(1, kv_heads, n + 3, dim, generator=gen).to(dtype) for n in lengths]
    return q, k_new, v_new, keys, values


@pytest.mark.skipif(not BUILDS, reason="no native kernels at this CPU level")
@pytest.mark.parametrize(("name", "attend", "dtype"), BUILDS, ids=IDS)
@pytest.mark.parametrize("window", [0, 300])
def test_each_build_attends_as_sdpa_and_writes_the_new_kv(name, attend, dtype, window):
    atol, rtol = decode_kernels._TOLERANCE[dtype]
    for i, shape in enumerate(SHAPES):
        for j, lengths in enumerate(LENGTHS):
            if shape[2] % (32 if dtype == torch.bfloat16 else 16):
                continue  # the build's head dims: multiples of 32 (bf16) or 16 (fp32)
            q, k_new, v_new, keys, values = _case(shape, lengths, dtype, seed=10 * i + j)
            want = decode_kernels._sdpa(q, k_new, v_new, keys, values, lengths, window)
            got = attend(q, k_new, v_new, keys, values, lengths, window, 0.2)
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
            for b, p in enumerate(lengths):
                assert torch.equal(keys[b][:, :, p], k_new[:, :, b])
                assert torch.equal(values[b][:, :, p], v_new[:, :, b])


@pytest.mark.skipif(not BUILDS, reason="no native kernels at this CPU level")
@pytest.mark.parametrize(("name", "attend", "dtype"), BUILDS, ids=IDS)
def test_each_requests_output_batched_is_its_output_alone_bit_for_bit(name, attend, dtype):
    lengths = [1100, 3, 513, 40]
    q, k_new, v_new, keys, values = _case((9, 3, 64), lengths, dtype, seed=7)
    given = [[t.clone() for t in ts] for ts in (keys, values)]
    together = attend(q, k_new, v_new, keys, values, lengths, 0, 0.125)
    for b, p in enumerate(lengths):
        one = [t[:, :, b : b + 1].contiguous() for t in (q, k_new, v_new)]
        alone = attend(*one, [given[0][b]], [given[1][b]], [p], 0, 0.125)
        assert torch.equal(alone[0, 0], together[0, b])


@pytest.mark.skipif(not BUILDS, reason="no native kernels at this CPU level")
@pytest.mark.parametrize(("name", "attend", "dtype"), BUILDS, ids=IDS)
def test_kv_rows_apart_wider_than_the_head_dim_give_what_dense_rows_give(name, attend, dtype):
    lengths = [600, 17]
    q, k_new, v_new, keys, values = _case((14, 2, 64), lengths, dtype, seed=11)
    wide = [torch.zeros(*t.shape[:-1], 96, dtype=dtype) for t in (*keys, *values)]
    for w, t in zip(wide, (*keys, *values)):
        w[..., :64] = t
    apart = [w[..., :64] for w in wide]  # rows 96 elements apart: the kernels' strided path
    assert apart[0].stride(2) == 96
    dense = attend(q, k_new, v_new, keys, values, lengths, 0, 0.125)
    strided = attend(q, k_new, v_new, apart[:2], apart[2:], lengths, 0, 0.125)
    assert torch.equal(strided, dense)
    for b, p in enumerate(lengths):
        assert torch.equal(apart[b][:, :, p], k_new[:, :, b])
        assert torch.equal(apart[2 + b][:, :, p], v_new[:, :, b])


@pytest.mark.skipif(not cpu_runs_kernel(torch.bfloat16), reason="CPU level below avx512_bf16")
def test_bf16_kernel_rejects_fp32_q_and_a_head_dim_it_does_not_take():
    build_kernels(torch.bfloat16)
    attend = torch.ops.ragblend_native.decode_attend
    q, k_new, v_new, keys, values = _case((4, 2, 64), [10], torch.bfloat16, seed=1)
    with pytest.raises(RuntimeError, match="bfloat16 q"):
        attend(q.float(), k_new, v_new, keys, values, [10], 0, 0.125)
    q, k_new, v_new, keys, values = _case((4, 2, 48), [10], torch.bfloat16, seed=1)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        attend(q, k_new, v_new, keys, values, [10], 0, 0.125)


@pytest.mark.skipif(
    not cpu.isa_at_least(decode_kernels.DECODE_512.level), reason="CPU level below avx512"
)
def test_the_fp32_kernels_decode_at_16_lanes_at_avx512_and_at_8_when_capped(monkeypatch):
    assert build_kernels(torch.float32).decode_attend is not None
    avx2 = torch.ops.ragblend_native_f32.decode_attend
    wide = decode_kernels.widest_fp32(avx2)
    assert wide is not avx2 and "ragblend_decode512" in str(wide)
    monkeypatch.setenv(cpu.ENV_CAP, "avx2")
    assert decode_kernels.widest_fp32(avx2) is avx2


@pytest.mark.skipif(
    not cpu.isa_at_least(decode_kernels.DECODE_512.level), reason="CPU level below avx512"
)
def test_a_failing_avx512_build_falls_back_to_avx2_with_one_warning(monkeypatch, caplog):
    build_kernels(torch.float32)
    avx2 = torch.ops.ragblend_native_f32.decode_attend

    def wrong(attend, dtype):
        raise RagblendError("the native torch.float32 decode attention does not match SDPA's")

    monkeypatch.setattr(decode_kernels, "check", wrong)
    with caplog.at_level("WARNING", logger=decode_kernels.__name__):
        assert decode_kernels.widest_fp32(avx2) is avx2
    (warning,) = [r for r in caplog.records if r.name == decode_kernels.__name__]
    assert "does not match" in warning.getMessage() and "AVX2" in warning.getMessage()


@pytest.mark.skipif(not cpu_runs_kernel(torch.bfloat16), reason="CPU level below avx512_bf16")
def test_a_bf16_kernel_failing_its_check_is_not_used_and_says_so(monkeypatch, caplog):
    build_kernels(torch.bfloat16)

    def wrong(attend, dtype):
        raise RagblendError("the native torch.bfloat16 decode attention does not match SDPA's")

    monkeypatch.setattr(decode_kernels, "check", wrong)
    with caplog.at_level("WARNING", logger=decode_kernels.__name__):
        assert decode_kernels.decode_kernel(torch.ops.ragblend_native, torch.bfloat16) is None
    (warning,) = [r for r in caplog.records if r.name == decode_kernels.__name__]
    assert "bf16 decode steps attend in fp32" in warning.getMessage()
