"""llama.cpp's 8-bit-activation arithmetic for GGUF quantized weights, in plain torch integers.

The oracle of :mod:`ragblend.kernels.cpu.int8_decode`'s kernels (and their fallback's definition).
A decode step's input row is quantized per block of the weight's type, as llama.cpp quantizes
activations for its integer dot products:

- **Q8_0** (for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 weights, blocks of 32): ``d = amax / 127``,
  ``q = round(x * (1 / d))`` (round half to even, as ggml's AVX quantizer; 0 where ``d`` is 0),
  ``d`` kept as float16 (ggml's ``block_q8_0``);
- **Q8_K** (for Q4_K, Q5_K, Q6_K, blocks of 256): the same codes per 256 values with ``d``
  kept in float32, and the sums of the codes per 16 (ggml's ``bsums``).

A weight block is its integer quants ``u`` (unsigned, minus a type's fixed offset: Q4_0 8,
Q5_0 16, Q6_K 32), integer sub-block scales (K types: 6-bit per 32, Q6_K int8 per 16) and its
float16 scales. Per block of x and w, the integer dot product is exact (int64 here; int32 in
the kernels, which cannot overflow for these ranges) and combined in float32 as ggml does::

    small types:  (d_w * d_x) * isum  [+ m_w * (d_x * sum(q_x))]             (Q4_1, Q5_1)
    K types:      (d_w * d_x) * sum_j sc_j * isum_j  [- (dmin_w * d_x) * sum_j m_j * bsum_j]

and the blocks' terms summed over the row. The kernels equal this to float32 rounding of that
per-block combination (another summation order of the same terms).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ragblend.kernels.cpu.quant_kernels import QUANT_TYPES, block_shape

SMALL_TYPES = (2, 3, 6, 7, 8)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: x in Q8_0 blocks of 32
K_TYPES = (12, 13, 14)  # Q4_K, Q5_K, Q6_K: x in Q8_K blocks of 256
_OFFSET = {2: 8, 6: 16, 14: 32}  # subtracted from a type's unsigned quants


def x_block(qtype: int) -> int:
    """Values of x per quantized activation block for weights of ``qtype``: 32 or 256."""
    return 256 if qtype in K_TYPES else 32


class QuantizedRows(NamedTuple):
    """x [n, cols] as 8-bit blocks: ``q`` int8 [n, cols], ``d`` float32 [n, cols / block]
    (Q8_0: values of float16), ``sums16`` int64 [n, cols / 16] (each 16 codes' sum)."""

    q: torch.Tensor
    d: torch.Tensor
    sums16: torch.Tensor


def quantize_rows(x: torch.Tensor, block: int) -> QuantizedRows:
    """float32 ``x`` [n, cols] (cols a multiple of ``block``) as Q8_0 (``block`` 32, ``d`` rounded
    to float16) or Q8_K (``block`` 256) codes; see the module docstring."""
    n, cols = x.shape
    blocks = x.float().reshape(n, cols // block, block)
    d = blocks.abs().amax(-1) / 127
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None]).to(torch.int8).reshape(n, cols)
    if block == 32:
        d = d.half().float()
    sums16 = q.to(torch.int64).reshape(n, cols // 16, 16).sum(-1)
    return QuantizedRows(q, d, sums16)


class IntegerWeight(NamedTuple):
    """A quantized weight [rows, cols] as integers: ``u`` int64 [rows, cols] (the quants minus
    the type's offset), ``scale`` int64 [rows, cols / span] (ones for the small types),
    ``d`` float32 [rows, blocks], ``m`` float32 [rows, blocks] or None (Q4_1 / Q5_1: the
    block's minimum; K types: dmin), ``mins`` int64 [rows, cols / 32] or None (K types' 6-bit
    minimum per 32)."""

    u: torch.Tensor
    scale: torch.Tensor
    span: int
    d: torch.Tensor
    m: torch.Tensor | None
    mins: torch.Tensor | None


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian float16 fields -> float32 [...]."""
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 16] -> int64 [..., 32]: the low nibbles, then the high ones."""
    qs = qs.to(torch.int64)
    return torch.cat([qs & 15, qs >> 4], -1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4] (a little-endian uint32) -> int64 [..., 32]: bit l of it at l."""
    bytes_ = qh.to(torch.int64)
    shifts = torch.arange(8)
    return ((bytes_[..., :, None] >> shifts) & 1).flatten(-2)


def _k_scales(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes [..., 12] of a Q4_K / Q5_K block -> (scales, mins), int64 [..., 8]."""
    q = raw.to(torch.int64)
    sc = torch.cat([q[..., 0:4] & 63, (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)], -1)
    mn = torch.cat([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def integer_weight(blocks: torch.Tensor, qtype: int, cols: int) -> IntegerWeight:
    """uint8 blocks [rows, row_bytes] of ggml type ``qtype`` as :class:`IntegerWeight`."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"no 8-bit-activation arithmetic for ggml type {qtype}")
    elems, size = block_shape(qtype)
    rows = blocks.shape[0]
    b = blocks.reshape(rows, cols // elems, size)
    ones = torch.ones(rows, cols // 32, dtype=torch.int64)
    m = mins = None
    if qtype == 8:  # Q8_0: d, 32 int8
        u = b[..., 2:].contiguous().view(torch.int8).to(torch.int64)
        return IntegerWeight(u.reshape(rows, cols), ones, 32, _f16(b[..., 0:2]), None, None)
    if qtype in (2, 3, 6, 7):
        head = 2 if qtype in (2, 6) else 4  # d (and m) before the quants' bits
        if qtype in (3, 7):
            m = _f16(b[..., 2:4])
        if qtype in (6, 7):
            u = _nibbles(b[..., head + 4 :]) | (_bits32(b[..., head : head + 4]) << 4)
        else:
            u = _nibbles(b[..., head:])
        u = u - _OFFSET.get(qtype, 0)
        return IntegerWeight(u.reshape(rows, cols), ones, 32, _f16(b[..., 0:2]), m, None)
    if qtype in (12, 13):  # Q4_K / Q5_K: d, dmin, 12 scale bytes, (qh 32,) qs 128
        sc, mins = _k_scales(b[..., 4:16])
        qs = b[..., -128:].to(torch.int64).reshape(rows, -1, 4, 32)
        u = torch.stack([qs & 15, qs >> 4], 3).reshape(rows, -1, 256)  # sub-block 2i, 2i+1
        if qtype == 13:
            qh = b[..., 16:48].to(torch.int64)[:, :, None, :]  # bit j of qh[l]: sub-block j
            u = u | ((((qh >> torch.arange(8)[:, None]) & 1) << 4).reshape(rows, -1, 256))
        return IntegerWeight(
            u.reshape(rows, cols),
            sc.reshape(rows, -1),
            32,
            _f16(b[..., 0:2]),
            _f16(b[..., 2:4]),
            mins.reshape(rows, -1),
        )
    # Q6_K: ql 128, qh 64, 16 int8 scales, d; weight 128 h + 32 t + l
    ql = b[..., 0:128].to(torch.int64).reshape(rows, -1, 2, 2, 32)  # [h, t % 2, l]
    qh = b[..., 128:192].to(torch.int64).reshape(rows, -1, 2, 1, 32)  # [h, l]
    low = torch.stack(
        [ql[..., 0, :] & 15, ql[..., 1, :] & 15, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], 3
    )
    high = (qh >> (2 * torch.arange(4)[:, None])) & 3
    u = (low | (high << 4)).reshape(rows, cols) - 32
    sc = b[..., 192:208].contiguous().view(torch.int8).to(torch.int64).reshape(rows, -1)
    return IntegerWeight(u, sc, 16, _f16(b[..., 208:210]), None, None)


def dequantized(weight: IntegerWeight) -> torch.Tensor:
    """float32 [rows, cols] the integers stand for (d * sc * u [+ m | - dmin * min]): the
    gguf package's values to float32 rounding (a check that the unpacking is right)."""
    rows, cols = weight.u.shape
    blocks = weight.d.shape[1]
    per_block = cols // blocks
    d = weight.d.repeat_interleave(per_block, 1)
    values = d * (weight.scale.repeat_interleave(weight.span, 1) * weight.u).float()
    if weight.mins is not None and weight.m is not None:
        values -= (
            weight.m.repeat_interleave(per_block, 1) * weight.mins.repeat_interleave(32, 1).float()
        )
    elif weight.m is not None:
        values += weight.m.repeat_interleave(per_block, 1)
    return values


def matmul_reference(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    cols: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [n, rows]: float32 ``x`` [n, cols] times the weights in llama.cpp's 8-bit
    arithmetic (module docstring), ``+ bias``: the value the int8 kernels must give."""
    w = integer_weight(blocks, qtype, cols)
    block = x_block(qtype)
    xq = quantize_rows(x, block)
    n, rows = x.shape[0], w.u.shape[0]
    nb = cols // block
    qx = xq.q.to(torch.int64).reshape(n, nb, block // w.span, w.span)
    u = w.u.reshape(rows, nb, block // w.span, w.span)
    spans = torch.einsum("njsk,rjsk->nrjs", qx, u)  # exact: int64
    isum = (spans * w.scale.reshape(rows, nb, -1)).sum(-1)  # [n, rows, nb]
    d = w.d[None] * xq.d[:, None]  # [n, rows, nb]
    out = d * isum.float()
    if w.mins is not None and w.m is not None:  # K types: dmin * sum_j min_j * bsum_j
        bsum32 = xq.sums16.reshape(n, nb, -1, 2).sum(-1)  # [n, nb, 8]
        msum = torch.einsum("nbj,rbj->nrb", bsum32, w.mins.reshape(rows, nb, -1))
        out = out - (w.m[None] * xq.d[:, None]) * msum.float()
    elif w.m is not None:  # Q4_1 / Q5_1: m * d_x * sum(q_x)
        sx = xq.sums16.reshape(n, nb, 2).sum(-1).float()
        out = out + w.m[None] * (xq.d * sx)[:, None]
    result = out.sum(-1)
    return result if bias is None else result + bias.float()


def term_bound(
    x: torch.Tensor, blocks: torch.Tensor, qtype: int, cols: int, bias: torch.Tensor | None
) -> torch.Tensor:
    """float32 [n, rows]: a bound on the float32 rounding difference between two summation
    orders of :func:`matmul_reference`'s terms: 1e-6 of their absolute sum (with ``|x|`` times
    ``|w|`` over each block) plus 1e-6 and the bias's ulp."""
    w = integer_weight(blocks, qtype, cols)
    magnitude = x.float().abs() @ dequantized(w).abs().T
    bound = magnitude * 1e-6 + 1e-6
    return bound if bias is None else bound + bias.float().abs() * 1e-6
