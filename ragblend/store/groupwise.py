"""Group-wise low-bit codes of chunk KV (KIVI's layout): ``int4``, ``int2``, ``k8v4``, ``k4v8``.

Asymmetric codes with one float16 scale and minimum per group of :data:`GROUP` values:

- keys per channel, grouped along tokens: a scale per (head, channel, 64 tokens), so an outlier
  token moves the scale of its group only, not of the chunk's 512 tokens;
- values per token, grouped along channels: a scale per (head, token, 64 channels).

``x ≈ min + code * scale`` with ``code`` in ``[0, 2**bits - 1]`` (rounded to nearest), within
``scale / 2`` of ``x`` per element. ``int4``/``int2`` code keys and values with 4/2 bits,
``k8v4`` keys with 8 and values with 4, ``k4v8`` the other way round. Codes are packed
``8 // bits`` to a byte along the head dimension. Stored tensors per layer: ``k``/``v`` uint8
[kv_heads, tokens, head_dim * bits / 8], ``k_scale``/``k_min`` float16 [kv_heads,
ceil(tokens / 64), head_dim], ``v_scale``/``v_min`` float16 [kv_heads, tokens,
ceil(head_dim / 64)]. Bytes per value: ``bits / 8`` plus 4 bytes of
scale and minimum per 64 values (``int4``: 4.5 bits a value, 0.28 of bfloat16).
"""

from __future__ import annotations

import torch

GROUP = 64
# (key bits, value bits) per codec name: ``k8v4`` and ``k4v8`` spend the same bytes on either
# side (docs/stores.md compares them)
GROUPWISE_BITS: dict[str, tuple[int, int]] = {
    "int4": (4, 4),
    "int2": (2, 2),
    "k8v4": (8, 4),
    "k4v8": (4, 8),
}


def encode(k: torch.Tensor, v: torch.Tensor, bits: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Codes of K and V [..., kv_heads, tokens, head_dim] (any float dtype; leading dims such
    as layers kept) with ``bits`` (for K, for V) as the stored tensors named in the module
    docstring."""
    k_bits, v_bits = bits
    if k.shape[-1] % (8 // min(bits)):
        raise ValueError(f"head_dim {k.shape[-1]} is not a multiple of {8 // min(bits)}")
    kq, kscale, kmin = _quantize(k.float().transpose(-1, -2), k_bits)  # channels, token groups
    vq, vscale, vmin = _quantize(v.float(), v_bits)  # tokens, channel groups
    return {
        "k": _pack(kq.transpose(-1, -2), k_bits),
        "k_scale": kscale.transpose(-1, -2).contiguous(),
        "k_min": kmin.transpose(-1, -2).contiguous(),
        "v": _pack(vq, v_bits),
        "v_scale": vscale,
        "v_min": vmin,
    }


def decode(
    tensors: dict[str, torch.Tensor], bits: tuple[int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [..., kv_heads, tokens, head_dim] in ``dtype`` from :func:`encode`'s tensors."""
    k_bits, v_bits = bits
    k = _dequantize_tokens(_unpack(tensors["k"], k_bits), tensors["k_scale"], tensors["k_min"])
    v = _dequantize(_unpack(tensors["v"], v_bits), tensors["v_scale"], tensors["v_min"])
    return k.to(dtype), v.to(dtype)


def bytes_per_token(
    bits: tuple[int, int], layers: int, kv_heads: int, head_dim: int, tokens: int
) -> float:
    """Stored bytes per token of a ``tokens``-token chunk (scales and minimums included)."""
    groups = -(-tokens // GROUP)
    codes = head_dim * sum(bits) / 8
    k_side = 4 * groups * head_dim / max(1, tokens)  # fp16 scale + min per channel group
    v_side = 4 * -(-head_dim // GROUP)
    return layers * kv_heads * (codes + k_side + v_side)


def _quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes of ``x`` [..., rows, n] grouped by :data:`GROUP` along the last dim: (uint8 codes
    like ``x``, float16 scale and minimum [..., rows, ceil(n / GROUP)])."""
    n = x.shape[-1]
    groups = -(-n // GROUP)
    pad = groups * GROUP - n  # the last group filled with its last value (no effect on range)
    padded = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], -1) if pad else x
    g = padded.reshape(*x.shape[:-1], groups, GROUP)
    lo = g.amin(-1).to(torch.float16)
    hi = g.amax(-1)
    top = (1 << bits) - 1
    scale = ((hi - lo.float()) / top).clamp_min(1e-8).to(torch.float16)
    codes = torch.round((g - lo.float().unsqueeze(-1)) / scale.float().unsqueeze(-1))
    codes = codes.clamp_(0, top).to(torch.uint8).reshape(*x.shape[:-1], groups * GROUP)
    return codes[..., :n].contiguous(), scale, lo


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``lo + codes * scale`` with one scale and minimum [..., rows, groups] per :data:`GROUP`
    values of the last dim of ``codes`` [..., rows, n] (float32): the keys' grouping with the
    values' channels as its tokens and one channel (views, no copies)."""
    out = _dequantize_tokens(codes.unsqueeze(-1), scale.unsqueeze(-1), lo.unsqueeze(-1))
    return out.squeeze(-1)


def _dequantize_tokens(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """``lo + codes * scale`` for keys: codes [..., tokens, d], one scale and minimum
    [..., groups, d] per :data:`GROUP` tokens of each channel (float32; no transposes)."""
    tokens, groups = codes.shape[-2], scale.shape[-2]
    out = torch.empty(codes.shape, dtype=torch.float32)
    full = min(groups, tokens // GROUP)
    if full:
        shape = (*codes.shape[:-2], full, GROUP, codes.shape[-1])
        src = codes[..., : full * GROUP, :].reshape(shape).float()
        body = out[..., : full * GROUP, :].view(shape)
        lo_, scale_ = lo[..., :full, None, :].float(), scale[..., :full, None, :].float()
        torch.addcmul(lo_, src, scale_, out=body)
    if full < groups:  # the last, shorter group
        tail = codes[..., full * GROUP :, :].float()
        out[..., full * GROUP :, :] = torch.addcmul(
            lo[..., full:, :].float(), tail, scale[..., full:, :].float()
        )
    return out


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``8 // bits`` codes to a byte along the last dim (first code in the low bits)."""
    per = 8 // bits  # encode() checked that head_dim is a multiple of it
    c = codes.reshape(*codes.shape[:-1], -1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8).contiguous()


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    per = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (i * bits)) & mask for i in range(per)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], -1)
