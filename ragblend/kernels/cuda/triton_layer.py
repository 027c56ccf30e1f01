"""Triton kernels of :mod:`ragblend.kernels.cuda.layer_ops`' steps, for CUDA tensors.

Each step of a layer that :mod:`~ragblend.kernels.cuda.layer_ops` defines (RMSNorm, residual add +
RMSNorm, RoPE of q and k, RoPE of keys in place, ``silu(gate) * up``, the K/V row scatter) is
here **one** Triton kernel launch, with the torch reference's signature and semantics:

* arithmetic in fp32 inside the kernel, rounded to the tensors' dtype where the reference
  rounds, to nearest with ties to even as torch rounds (bf16 by the value's bits, which
  Triton's interpreter then runs as a GPU does: its own cast to bf16 truncates);
* every launch passes ``enable_fp_fusion=False``, so a product followed by a sum is not
  contracted into an FMA where the reference rounds the product first; where the reference
  itself computes an FMA (``addcmul_`` in :func:`~ragblend.kernels.cuda.layer_ops.
  rope_inplace_reference`) the kernel calls ``tl.fma``;
* divisions are IEEE (``tl.div_rn``) and, on a GPU, ``silu``'s ``exp`` is libdevice's
  ``expf`` (torch's on CUDA), not Triton's approximate ``exp``.

What is left between a kernel and its reference in fp32 is the order of the RMSNorm's sum of
squares (a reduction tree of its own), the last ulp of ``exp``/``rsqrt`` and, on CUDA, where
torch's ``addcmul_(..., value=-1)`` rounds its product before the FMA (one ulp of RoPE in
place's first half; torch's CPU build and ``value=1`` fuse as the kernel does). bf16/fp16
outputs agree but where such an fp32 difference moves a rounding (one ulp of the dtype).

``triton`` is optional: this module imports without it (:func:`available` then says False and
:func:`triton_impl` raises). The kernels are checked against the torch references on the CPU
with ``TRITON_INTERPRET=1`` (``tests/test_triton_layer.py``, where Triton's interpreter runs
them over CPU tensors) and on the device when :mod:`~ragblend.kernels.cuda.loading` loads them.

Assumptions (as the references' callers have them): ``q``/``k`` batch 1 and ``cos``/``sin``
[1, T, d] (or [T, d]); ``hidden`` and ``delta`` of one shape; ``k``/``v`` and ``k_all``/
``v_all`` of one dtype; ``rows`` in range (not checked on the device, as a sync would cost
more than the kernel). Any strides are read as they are (no copies), but for ``x`` of
:func:`rms_norm`/:func:`add_rms_norm` and ``gate``/``up`` of :func:`silu_mul`, which must
flatten to rows by a view (a ``reshape`` copies them otherwise).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ragblend.kernels.cuda.layer_ops import LayerImpl

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError as exc:  # pragma: no cover - where triton is not installed
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

# the longest row RMSNorm reads in one block; longer rows loop over blocks of half this size
_NORM_ONE_PASS_MAX = 8192
# the elements one program of the RoPE / scatter kernels holds per tile (per half for RoPE)
_TILE = 2048


def available() -> bool:
    """Whether Triton is importable (the kernels can be built)."""
    return _IMPORT_ERROR is None


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# whether the kernels below are Triton's interpreter's (TRITON_INTERPRET=1 when this module
# was imported, as ``triton.jit`` decides then): no libdevice there
_INTERPRET = _IMPORT_ERROR is None and _interpreting()


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


def _opts(block: int) -> dict[str, Any]:
    return {"num_warps": _warps(block), "enable_fp_fusion": False}


if _IMPORT_ERROR is None:

    @triton.jit
    def _round(x, ty: tl.constexpr):
        # fp32 x rounded to ty's precision (to nearest, ties to even), kept in fp32. bf16 by
        # its bits: Triton's interpreter truncates a cast to bf16 (the GPU's cvt rounds), so
        # this is what both run; a bf16-exact value then casts exactly anywhere
        if ty == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            out = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
        elif ty == tl.float32:
            out = x
        else:
            out = x.to(ty).to(tl.float32)
        return out

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        y_ptr,
        t_ptr,
        w_ptr,
        o_ptr,
        n_cols,
        n_cols_f,
        sx_r,
        sx_c,
        sy_r,
        sy_c,
        st_r,
        st_c,
        s_w,
        so_r,
        eps,
        HAS_DELTA: tl.constexpr,
        ONE_PASS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # one row per program. t_ptr: the norm's input (the sum's output with HAS_DELTA,
        # else x itself); its dtype is the one the normalised row is rounded to.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ty = t_ptr.dtype.element_ty
        oty = o_ptr.dtype.element_ty
        if ONE_PASS:
            m = cols < n_cols
            h = tl.load(x_ptr + row * sx_r + cols * sx_c, mask=m, other=0.0).to(tl.float32)
            if HAS_DELTA:
                dl = tl.load(y_ptr + row * sy_r + cols * sy_c, mask=m, other=0.0)
                h = _round(h + dl.to(tl.float32), ty)
                tl.store(t_ptr + row * st_r + cols * st_c, h.to(ty), mask=m)
            var = tl.div_rn(tl.sum(h * h, axis=0), n_cols_f)
            r = tl.rsqrt(var + eps)
            normed = _round(h * r, ty)
            w = tl.load(w_ptr + cols * s_w, mask=m, other=0.0).to(tl.float32)
            tl.store(o_ptr + row * so_r + cols, _round(w * normed, oty).to(oty), mask=m)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, n_cols, BLOCK):
                c = start + cols
                m = c < n_cols
                h = tl.load(x_ptr + row * sx_r + c * sx_c, mask=m, other=0.0).to(tl.float32)
                if HAS_DELTA:
                    dl = tl.load(y_ptr + row * sy_r + c * sy_c, mask=m, other=0.0)
                    h = _round(h + dl.to(tl.float32), ty)
                    tl.store(t_ptr + row * st_r + c * st_c, h.to(ty), mask=m)
                acc += h * h
            var = tl.div_rn(tl.sum(acc, axis=0), n_cols_f)
            r = tl.rsqrt(var + eps)
            for start in range(0, n_cols, BLOCK):
                c = start + cols
                m = c < n_cols
                # the same thread stored these elements of the sum above
                h = tl.load(t_ptr + row * st_r + c * st_c, mask=m, other=0.0).to(tl.float32)
                normed = _round(h * r, ty)
                w = tl.load(w_ptr + c * s_w, mask=m, other=0.0).to(tl.float32)
                tl.store(o_ptr + row * so_r + c, _round(w * normed, oty).to(oty), mask=m)

    @triton.jit
    def _rope_tile(
        src,
        s_h,
        s_t,
        s_d,
        dst,
        o_h,
        o_t,
        o_d,
        n_heads,
        h0,
        t,
        half,
        c1,
        s1,
        c2,
        s2,
        BH: tl.constexpr,
        BD: tl.constexpr,
        FMA: tl.constexpr,
    ):
        # heads h0 .. h0+BH of one position t: x1 = x[:half], x2 = x[half:]
        hs = (h0 + tl.arange(0, BH)).to(tl.int64)
        ds = tl.arange(0, BD)
        m = (hs < n_heads)[:, None] & (ds < half)[None, :]
        src_row = src + t * s_t + hs[:, None] * s_h
        x1 = tl.load(src_row + ds[None, :] * s_d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src_row + (ds[None, :] + half) * s_d, mask=m, other=0.0).to(tl.float32)
        ty = dst.dtype.element_ty
        if FMA:
            # rope_inplace_reference: mul_ (rounded), then addcmul_ (one fma, one rounding)
            o1 = tl.fma(-x2, s1, _round(x1 * c1, ty))
            o2 = tl.fma(x1, s2, _round(x2 * c2, ty))
        else:
            # rope_qk_reference: x*cos and rotate_half(x)*sin each rounded, then summed
            o1 = _round(x1 * c1, ty) - _round(x2 * s1, ty)
            o2 = _round(x2 * c2, ty) + _round(x1 * s2, ty)
        dst_row = dst + t * o_t + hs[:, None] * o_h
        tl.store(dst_row + ds[None, :] * o_d, _round(o1, ty).to(ty), mask=m)
        tl.store(dst_row + (ds[None, :] + half) * o_d, _round(o2, ty).to(ty), mask=m)

    @triton.jit
    def _rope_kernel(
        q,
        k,
        qo,
        ko,
        cos,
        sin,
        n_q,
        n_k,
        n_q_blocks,
        half,
        sq_h,
        sq_t,
        sq_d,
        sk_h,
        sk_t,
        sk_d,
        oq_h,
        oq_t,
        oq_d,
        ok_h,
        ok_t,
        ok_d,
        sc_t,
        sc_d,
        ss_t,
        ss_d,
        BHQ: tl.constexpr,
        BHK: tl.constexpr,
        BD: tl.constexpr,
        FMA: tl.constexpr,
    ):
        # grid (T, q head blocks + k head blocks): one position's cos/sin, a block of heads
        t = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        ds = tl.arange(0, BD)
        dm = ds < half
        c1 = tl.load(cos + t * sc_t + ds * sc_d, mask=dm, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cos + t * sc_t + (ds + half) * sc_d, mask=dm, other=0.0)
        s1 = tl.load(sin + t * ss_t + ds * ss_d, mask=dm, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sin + t * ss_t + (ds + half) * ss_d, mask=dm, other=0.0)
        c2 = c2.to(tl.float32)[None, :]
        s2 = s2.to(tl.float32)[None, :]
        if blk < n_q_blocks:
            _rope_tile(
                q, sq_h, sq_t, sq_d, qo, oq_h, oq_t, oq_d, n_q, blk * BHQ, t, half,
                c1, s1, c2, s2, BHQ, BD, FMA,
            )  # fmt: skip
        else:
            _rope_tile(
                k, sk_h, sk_t, sk_d, ko, ok_h, ok_t, ok_d, n_k, (blk - n_q_blocks) * BHK, t,
                half, c1, s1, c2, s2, BHK, BD, FMA,
            )  # fmt: skip

    @triton.jit
    def _silu_mul_kernel(
        g_ptr,
        u_ptr,
        o_ptr,
        n_cols,
        sg_r,
        sg_c,
        su_r,
        su_c,
        so_r,
        BLOCK: tl.constexpr,
        PRECISE: tl.constexpr,
    ):
        # grid (rows, column blocks). silu in fp32, rounded to gate's dtype (F.silu), then
        # the product rounded to the output's (gate and up promoted)
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = c < n_cols
        g = tl.load(g_ptr + row * sg_r + c * sg_c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su_r + c * su_c, mask=m, other=0.0).to(tl.float32)
        if PRECISE:
            e = libdevice.exp(-g)
        else:
            e = tl.exp(-g)
        act = _round(tl.div_rn(g, 1.0 + e), g_ptr.dtype.element_ty)
        oty = o_ptr.dtype.element_ty
        tl.store(o_ptr + row * so_r + c, _round(act * u, oty).to(oty), mask=m)

    @triton.jit
    def _scatter_rows_kernel(
        k_all,
        v_all,
        rows,
        k,
        v,
        n_heads,
        head_dim,
        s_rows,
        ska_h,
        ska_n,
        ska_d,
        sva_h,
        sva_n,
        sva_d,
        sk_h,
        sk_m,
        sk_d,
        sv_h,
        sv_m,
        sv_d,
        BH: tl.constexpr,
        BD: tl.constexpr,
    ):
        # grid (m, head blocks): fresh row j of a block of heads, of K and of V
        j = tl.program_id(0).to(tl.int64)
        hs = (tl.program_id(1) * BH + tl.arange(0, BH)).to(tl.int64)[:, None]
        ds = tl.arange(0, BD)[None, :]
        m = (hs < n_heads) & (ds < head_dim)
        r = tl.load(rows + j * s_rows).to(tl.int64)
        kv = tl.load(k + j * sk_m + hs * sk_h + ds * sk_d, mask=m)
        tl.store(k_all + r * ska_n + hs * ska_h + ds * ska_d, kv, mask=m)
        vv = tl.load(v + j * sv_m + hs * sv_h + ds * sv_d, mask=m)
        tl.store(v_all + r * sva_n + hs * sva_h + ds * sva_d, vv, mask=m)


# ---------------------------------------------------------------------- the steps
def _norm_launch(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    total: torch.Tensor | None,
    weight: torch.Tensor,
    out: torch.Tensor,
    eps: float,
) -> None:
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols)
    rows = x2.shape[0]
    if rows == 0 or n_cols == 0:
        return
    y2 = x2 if delta is None else delta.reshape(-1, n_cols)
    t2 = x2 if total is None else total.view(-1, n_cols)
    one_pass = n_cols <= _NORM_ONE_PASS_MAX
    block = _pow2(n_cols) if one_pass else _NORM_ONE_PASS_MAX // 2
    _rms_norm_kernel[(rows,)](
        x2, y2, t2, weight, out, n_cols, float(n_cols),
        x2.stride(0), x2.stride(1), y2.stride(0), y2.stride(1), t2.stride(0), t2.stride(1),
        weight.stride(0), n_cols, float(eps),
        HAS_DELTA=delta is not None, ONE_PASS=one_pass, BLOCK=block, **_opts(block),
    )  # fmt: skip


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"RMSNorm weight of shape {tuple(weight.shape)} for rows of {x.shape[-1]} values"
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of ``x`` [..., D] in one kernel (see ``rms_norm_reference``)."""
    _check_weight(x, weight)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _norm_launch(x, None, None, weight, out, eps)
    return out


def add_rms_norm(
    hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden + delta`` and its RMSNorm, both written by one kernel (see
    ``add_rms_norm_reference``)."""
    if hidden.shape != delta.shape:
        raise ValueError(
            f"add_rms_norm of {tuple(hidden.shape)} and {tuple(delta.shape)}: one shape needed"
        )
    _check_weight(hidden, weight)
    total_dtype = torch.promote_types(hidden.dtype, delta.dtype)
    total = torch.empty(hidden.shape, dtype=total_dtype, device=hidden.device)
    normed = torch.empty(
        hidden.shape, dtype=torch.promote_types(weight.dtype, total_dtype), device=hidden.device
    )
    _norm_launch(hidden, delta, total, weight, normed, eps)
    return total, normed


def _rope_shapes(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[int, int, int]:
    if x.dim() != 4 or x.shape[0] != 1:
        raise ValueError(f"RoPE of a tensor of shape {tuple(x.shape)}: [1, heads, T, d] needed")
    _, heads, n, d = x.shape
    for c in (cos, sin):
        if c.dim() not in (2, 3) or (c.dim() == 3 and c.shape[0] != 1) or c.shape[-2:] != (n, d):
            raise ValueError(f"cos/sin of shape {tuple(c.shape)} for {tuple(x.shape)}")
    if d % 2:
        raise ValueError(f"RoPE of an odd head size {d}")
    return heads, n, d


def _heads_block(heads: int, bd: int) -> int:
    return max(1, min(_pow2(heads), _TILE // bd))


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [1, H, T, d] and k [1, Hkv, T, d] (any strides), both written by
    one kernel (see ``rope_qk_reference``); the copies are contiguous."""
    n_q, n, d = _rope_shapes(q, cos, sin)
    n_k, _, _ = _rope_shapes(k, cos, sin)
    dtype = torch.promote_types(cos.dtype, sin.dtype)
    q_rot = torch.empty((1, n_q, n, d), dtype=torch.promote_types(q.dtype, dtype), device=q.device)
    k_rot = torch.empty((1, n_k, n, d), dtype=torch.promote_types(k.dtype, dtype), device=k.device)
    if n == 0 or n_q + n_k == 0:
        return q_rot, k_rot
    half = d // 2
    bd = _pow2(half)
    bhq, bhk = _heads_block(n_q, bd), _heads_block(n_k, bd)
    n_q_blocks = triton.cdiv(n_q, bhq)
    grid = (n, n_q_blocks + triton.cdiv(n_k, bhk))
    _rope_kernel[grid](
        q, k, q_rot, k_rot, cos, sin, n_q, n_k, n_q_blocks, half,
        q.stride(1), q.stride(2), q.stride(3), k.stride(1), k.stride(2), k.stride(3),
        q_rot.stride(1), q_rot.stride(2), q_rot.stride(3),
        k_rot.stride(1), k_rot.stride(2), k_rot.stride(3),
        cos.stride(-2), cos.stride(-1), sin.stride(-2), sin.stride(-1),
        BHQ=bhq, BHK=bhk, BD=bd, FMA=False, **_opts(max(bhq, bhk) * bd),
    )  # fmt: skip
    return q_rot, k_rot


def rope_inplace(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """RoPE applied to keys [1, Hkv, T, d] in place by one kernel (see
    ``rope_inplace_reference``)."""
    heads, n, d = _rope_shapes(k, cos, sin)
    if n == 0 or heads == 0:
        return
    half = d // 2
    bd = _pow2(half)
    bh = _heads_block(heads, bd)
    n_blocks = triton.cdiv(heads, bh)
    sh, st, sd = k.stride(1), k.stride(2), k.stride(3)
    _rope_kernel[(n, n_blocks)](
        k, k, k, k, cos, sin, heads, 0, n_blocks, half,
        sh, st, sd, sh, st, sd, sh, st, sd, sh, st, sd,
        cos.stride(-2), cos.stride(-1), sin.stride(-2), sin.stride(-1),
        BHQ=bh, BHK=1, BD=bd, FMA=True, **_opts(bh * bd),
    )  # fmt: skip


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of two [..., I] (any strides that flatten to rows by a view, e.g. the
    halves of a fused gate/up projection) in one kernel (see ``silu_mul_reference``)."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul of {tuple(gate.shape)} and {tuple(up.shape)}: one shape")
    n_cols = gate.shape[-1]
    dtype = torch.promote_types(gate.dtype, up.dtype)
    out = torch.empty(gate.shape, dtype=dtype, device=gate.device)
    g2, u2 = gate.reshape(-1, n_cols), up.reshape(-1, n_cols)
    rows = g2.shape[0]
    if rows == 0 or n_cols == 0:
        return out
    block = min(_pow2(n_cols), 1024)
    grid = (rows, triton.cdiv(n_cols, block))
    _silu_mul_kernel[grid](
        g2, u2, out, n_cols, g2.stride(0), g2.stride(1), u2.stride(0), u2.stride(1), n_cols,
        BLOCK=block, PRECISE=not _INTERPRET, **_opts(block),
    )  # fmt: skip
    return out


def scatter_rows(
    k_all: torch.Tensor, v_all: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Fresh K/V [1, Hkv, m, d] (any strides) written into the prompt's K/V [1, Hkv, N, d] at
    ``rows`` [m] by one kernel (see ``scatter_rows_reference``)."""
    for name, t in (("k_all", k_all), ("v_all", v_all), ("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[0] != 1:
            raise ValueError(f"scatter_rows: {name} of shape {tuple(t.shape)}, not [1, Hkv, *, d]")
    m = rows.shape[0]
    if rows.dim() != 1 or k.shape[2] != m or v.shape[2] != m:
        raise ValueError(f"scatter_rows: {m} rows for k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.dtype != k_all.dtype or v.dtype != v_all.dtype:
        raise ValueError("scatter_rows: k/v and k_all/v_all must have one dtype")
    _, heads, _, d = k_all.shape
    for name, t in (("v_all", v_all), ("k", k), ("v", v)):
        if (t.shape[1], t.shape[3]) != (heads, d):
            raise ValueError(
                f"scatter_rows: {name} of shape {tuple(t.shape)} for k_all {tuple(k_all.shape)}"
            )
    if m == 0 or heads == 0 or d == 0:
        return
    bd = _pow2(d)
    bh = _heads_block(heads, bd)
    grid = (m, triton.cdiv(heads, bh))
    _scatter_rows_kernel[grid](
        k_all, v_all, rows, k, v, heads, d, rows.stride(0),
        k_all.stride(1), k_all.stride(2), k_all.stride(3),
        v_all.stride(1), v_all.stride(2), v_all.stride(3),
        k.stride(1), k.stride(2), k.stride(3), v.stride(1), v.stride(2), v.stride(3),
        BH=bh, BD=bd, **_opts(bh * bd),
    )  # fmt: skip


def triton_impl() -> LayerImpl:
    """The Triton kernels as a :class:`~ragblend.kernels.cuda.layer_ops.LayerImpl` (``"triton"``).

    RuntimeError where Triton is not installed (or fails to import)."""
    if _IMPORT_ERROR is not None:
        raise RuntimeError(
            f"the Triton layer kernels need the triton package ({_IMPORT_ERROR})"
        ) from _IMPORT_ERROR
    return LayerImpl(
        "triton", rms_norm, add_rms_norm, rope_qk, rope_inplace, silu_mul, scatter_rows
    )
