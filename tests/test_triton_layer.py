"""The Triton layer kernels (:mod:`ragblend.kernels.cuda.triton_layer`) against the torch
references of :mod:`ragblend.kernels.cuda.layer_ops`: compiled on CUDA tensors where there is
a GPU, else run by Triton's interpreter over CPU tensors (``conftest.py`` sets
``TRITON_INTERPRET=1`` on a machine without CUDA before anything imports triton: triton and
its language's own functions are made interpreted or compiled when it is first imported).

Tolerances: fp32 within a few ulps where the kernel cannot follow torch's arithmetic exactly
(RMSNorm's sum of squares is reduced in another order; ``exp`` in silu is numpy's, not
torch's), bit-exact where it can (RoPE's products and sums, the residual sum, the scatter);
bf16 within one bf16 ulp (an fp32 ulp of difference can move a rounding).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from ragblend.kernels.cuda.layer_ops import LayerImpl

pytest.importorskip("triton")

from ragblend.kernels.cuda import layer_ops as ref  # noqa: E402
from ragblend.kernels.cuda import triton_layer as TL  # noqa: E402


def _load(name: str) -> ModuleType:
    """A private copy of the kernels' module (to import it under other conditions)."""
    spec = importlib.util.spec_from_file_location(name, Path(TL.__file__))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip(
        "no GPU and TRITON_INTERPRET is not 1 (conftest.py sets it before triton is imported)",
        allow_module_level=True,
    )

EPS = 1e-6
KERNELS = (
    "_rms_norm_kernel",
    "_rope_kernel",
    "_silu_mul_kernel",
    "_scatter_rows_kernel",
)


def _tolerance(dtype: torch.dtype, scale: float) -> tuple[float, float]:
    """(atol, rtol): a few fp32 ulps of the values' scale; for bf16, one ulp (2**-8 of a value,
    within 1e-2)."""
    if dtype == torch.float32:
        return 1e-6 * scale, 1e-5
    return 1e-2 * scale, 1e-2


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    atol, rtol = _tolerance(want.dtype, max(1.0, want.float().abs().max().item()))
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def _cos_sin(n: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.arange(3, n + 3, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)[None]  # [1, T, d], as HF's rotary embedding
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _projected(n: int, heads: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, heads, T, d] as attention gets it: a transposed view of a [1, T, heads, d]."""
    return torch.randn(1, n, heads * d).to(dtype).view(1, n, heads, d).transpose(1, 2)


@pytest.fixture(autouse=True)
def _on_device() -> Iterator[None]:
    """Each test seeded, its tensors made on ``DEVICE``."""
    torch.manual_seed(0)
    previous = torch.get_default_device()
    torch.set_default_device(DEVICE)
    yield
    torch.set_default_device(previous)


class _Launches:
    """A kernel's stand-in that counts its launches and their grids."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, _Launches]]:
    counters = {name: _Launches(getattr(TL, name)) for name in KERNELS}
    for name, counter in counters.items():
        monkeypatch.setattr(TL, name, counter)
    yield counters


def test_triton_is_available_and_gives_a_layer_impl_of_its_kernels() -> None:
    assert TL.available()
    impl = TL.triton_impl()
    assert isinstance(impl, LayerImpl) and impl.name == "triton"
    assert impl[1:] == (
        TL.rms_norm,
        TL.add_rms_norm,
        TL.rope_qk,
        TL.rope_inplace,
        TL.silu_mul,
        TL.scatter_rows,
    )


def test_the_module_imports_without_triton_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "triton" or m.startswith("triton.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "triton", None)
    module = _load("_ragblend_triton_layer_without_triton")
    assert not module.available()
    with pytest.raises(RuntimeError, match="triton"):
        module.triton_impl()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 576, 1000])
def test_triton_rms_norm_matches_the_torch_reference(dtype: torch.dtype, dim: int) -> None:
    x = (torch.randn(3, 5, dim) * 4).to(dtype)
    weight = (torch.randn(dim) * 0.3 + 1).to(dtype)
    _assert_close(TL.rms_norm(x, weight, EPS), ref.rms_norm_reference(x, weight, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 1000])
def test_triton_add_rms_norm_matches_the_torch_reference(dtype: torch.dtype, dim: int) -> None:
    hidden, delta = (torch.randn(2, 7, dim) * 3).to(dtype), torch.randn(2, 7, dim).to(dtype)
    weight = (torch.randn(dim) * 0.3 + 1).to(dtype)
    total, normed = TL.add_rms_norm(hidden, delta, weight, EPS)
    want_total, want_normed = ref.add_rms_norm_reference(hidden, delta, weight, EPS)
    assert torch.equal(total, want_total)  # one addition, rounded once, as torch does
    _assert_close(normed, want_normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rms_norm_loops_over_blocks_of_a_long_row(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(TL, "_NORM_ONE_PASS_MAX", 256)  # rows of 1000: 8 blocks of 128
    x, delta = (torch.randn(4, 1000) * 2).to(dtype), torch.randn(4, 1000).to(dtype)
    weight = (torch.randn(1000) * 0.3 + 1).to(dtype)
    _assert_close(TL.rms_norm(x, weight, EPS), ref.rms_norm_reference(x, weight, EPS))
    total, normed = TL.add_rms_norm(x, delta, weight, EPS)
    want_total, want_normed = ref.add_rms_norm_reference(x, delta, weight, EPS)
    assert torch.equal(total, want_total)
    _assert_close(normed, want_normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "n", "d"), [(8, 2, 33, 64), (4, 4, 7, 128)])
def test_triton_rope_qk_matches_the_torch_reference_bit_for_bit(
    dtype: torch.dtype, heads: int, kv_heads: int, n: int, d: int
) -> None:
    # the kernel rounds where the reference does (x*cos, rotate_half(x)*sin, their sum): exact
    q, k = _projected(n, heads, d, dtype), _projected(n, kv_heads, d, dtype)
    assert not q.is_contiguous() and not k.is_contiguous()
    cos, sin = _cos_sin(n, d, dtype)
    q_rot, k_rot = TL.rope_qk(q, k, cos, sin)
    want_q, want_k = ref.rope_qk_reference(q, k, cos, sin)
    assert q_rot.is_contiguous() and k_rot.is_contiguous()
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)
    q_rot, k_rot = TL.rope_qk(q.contiguous(), k.contiguous(), cos[0], sin[0])  # cos [T, d]
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kv_heads", "n", "d"), [(2, 33, 64), (4, 7, 128)])
def test_triton_rope_inplace_matches_the_torch_reference(
    dtype: torch.dtype, kv_heads: int, n: int, d: int
) -> None:
    # fp32: the reference's addcmul_ is one FMA on torch's CPU build (the kernel's tl.fma);
    # compared within tolerance as another build may round its product first
    k = _projected(n, kv_heads, d, dtype).contiguous()
    cos, sin = _cos_sin(n, d, dtype)
    got, want = k.clone(), k.clone()
    TL.rope_inplace(got, cos, sin)
    ref.rope_inplace_reference(want, cos, sin)
    _assert_close(got, want)


def test_triton_rope_covers_heads_in_several_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TL, "_TILE", 64)  # d 64: blocks of 2 heads; 3 kv heads: one partial
    q, k = _projected(5, 8, 64, torch.float32), _projected(5, 3, 64, torch.float32)
    cos, sin = _cos_sin(5, 64, torch.float32)
    q_rot, k_rot = TL.rope_qk(q, k, cos, sin)
    want_q, want_k = ref.rope_qk_reference(q, k, cos, sin)
    assert torch.equal(q_rot, want_q) and torch.equal(k_rot, want_k)
    got, want = k.contiguous(), k.contiguous()
    TL.rope_inplace(got, cos, sin)
    ref.rope_inplace_reference(want, cos, sin)
    _assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inner", [576, 1500])
def test_triton_silu_mul_matches_the_torch_reference(dtype: torch.dtype, inner: int) -> None:
    gate_up = (torch.randn(2, 5, 2 * inner) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)  # the halves of a fused projection: strided views
    _assert_close(TL.silu_mul(gate, up), ref.silu_mul_reference(gate, up))
    gate, up = gate.contiguous(), up.contiguous()
    _assert_close(TL.silu_mul(gate, up), ref.silu_mul_reference(gate, up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_triton_scatter_rows_writes_the_rows_exactly(dtype: torch.dtype, d: int) -> None:
    kv_heads, n, m = 2, 33, 9
    rows = torch.randperm(n)[:m].sort().values  # ascending, m < N
    k_all, v_all = torch.randn(1, kv_heads, n, d).to(dtype), torch.randn(1, kv_heads, n, d)
    v_all = v_all.to(dtype)
    k, v = _projected(m, kv_heads, d, dtype), _projected(m, kv_heads, d, dtype)
    got_k, got_v, want_k, want_v = k_all.clone(), v_all.clone(), k_all.clone(), v_all.clone()
    assert TL.scatter_rows(got_k, got_v, rows, k, v) is None
    ref.scatter_rows_reference(want_k, want_v, rows, k, v)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert not torch.equal(got_k, k_all) and not torch.equal(got_v, v_all)


def test_out_of_place_triton_ops_leave_their_inputs_unchanged() -> None:
    x, delta, weight = torch.randn(3, 576), torch.randn(3, 576), torch.randn(576) + 1
    q, k = _projected(6, 8, 64, torch.bfloat16), _projected(6, 2, 64, torch.bfloat16)
    cos, sin = _cos_sin(6, 64, torch.bfloat16)
    gate, up = torch.randn(2, 4, 2000).chunk(2, dim=-1)
    inputs = (x, delta, weight, q, k, cos, sin, gate, up)
    before = [t.clone() for t in inputs]
    TL.rms_norm(x, weight, EPS)
    TL.add_rms_norm(x, delta, weight, EPS)
    TL.rope_qk(q, k, cos, sin)
    TL.silu_mul(gate, up)
    assert all(torch.equal(t, b) for t, b in zip(inputs, before, strict=True))


def test_triton_rope_inplace_rotates_the_keys_in_place_and_returns_none() -> None:
    k = _projected(5, 2, 64, torch.float32).contiguous()
    cos, sin = _cos_sin(5, 64, torch.float32)
    original, ptr = k.clone(), k.data_ptr()
    assert TL.rope_inplace(k, cos, sin) is None
    assert k.data_ptr() == ptr and not torch.equal(k, original)
    want = original.clone()
    ref.rope_inplace_reference(want, cos, sin)
    _assert_close(k, want)


def test_each_triton_op_is_one_kernel_launch(launches: dict[str, _Launches]) -> None:
    x, delta, weight = torch.randn(3, 4, 100), torch.randn(3, 4, 100), torch.randn(100)
    TL.rms_norm(x, weight, EPS)
    TL.add_rms_norm(x, delta, weight, EPS)
    assert launches["_rms_norm_kernel"].grids == [(12,), (12,)]  # a program per row
    q, k = _projected(5, 8, 64, torch.float32), _projected(5, 2, 64, torch.float32)
    cos, sin = _cos_sin(5, 64, torch.float32)
    TL.rope_qk(q, k, cos, sin)
    TL.rope_inplace(k.contiguous(), cos, sin)
    # per position: a block of q heads and one of k heads; in place: one block of k heads
    assert launches["_rope_kernel"].grids == [(5, 2), (5, 1)]
    gate, up = torch.randn(6, 1500).chunk(2, dim=-1)
    TL.silu_mul(gate, up)
    assert launches["_silu_mul_kernel"].grids == [(6, 1)]
    k_all, v_all = torch.zeros(1, 2, 9, 64), torch.zeros(1, 2, 9, 64)
    TL.scatter_rows(k_all, v_all, torch.tensor([1, 4, 5]), k[:, :, :3], k[:, :, 2:])
    assert launches["_scatter_rows_kernel"].grids == [(3, 1)]  # K and V in one launch
