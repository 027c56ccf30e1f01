"""A transform coder for chunk KV in KV Cache Transform Coding's manner: ``pca<bits>`` codecs.

Per layer, pre-RoPE keys and values are rotated into a basis calibrated once per model
(:class:`Basis`: the eigenvectors of each KV head's covariance over calibration chunks,
``ragblend.store.basis``), where a few components carry most of the variance. Each chunk then
stores, per layer and tensor:

- each component's mean and standard deviation over the chunk's tokens (float16), and
- every token's components quantized with a bit budget of ``bits × kv_heads × head_dim`` bits per
  token, allocated across the layer's components greedily by the chunk's own variances (each
  next bit to the component whose squared error it removes most, ``σ² · 4**-b``; at most 8):
  high-variance components get many bits, the tail none (it decodes to its mean). A component
  with ``b`` bits is quantized uniformly around its mean with the step that is optimal for a
  Gaussian of its deviation (:data:`STEP`), clamped at the outer levels.

The allocation is recomputed by the decoder from the stored float16 deviations, so nothing else
is stored: an entry's size depends only on its token count (the same for every layer, which
every tier's format wants). Stored tensors per layer: ``k``/``v`` uint8 [1, tokens,
budget / 8] (each token's codes as bit planes: bit 0 of every component with a bit, then bit 1
of those with two, …, components ordered by their bits)
and ``k_stats``/``v_stats`` float16 [2, kv_heads, head_dim] (mean, deviation). Bytes per token:
``2 × layers × (budget / 8)`` plus the statistics (8 bytes per component and chunk).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

PCA_NAME = re.compile(r"^pca(\d+(?:\.\d+)?)$")
# Step of the uniform quantizer with the least squared error for a unit Gaussian, by bits
# (Max 1960; Hui and Neuhoff 2001).
STEP = (0.0, 1.596, 0.9957, 0.586, 0.3352, 0.1881, 0.1041, 0.0569, 0.0308)
MAX_BITS = 8


def pca_bits(name: str) -> float | None:
    """Bits per value of a ``pca<bits>`` codec name (0 < bits <= 8), else None."""
    m = PCA_NAME.match(name)
    if m is None:
        return None
    bits = float(m.group(1))
    return bits if 0 < bits <= MAX_BITS else None


@dataclass(frozen=True)
class Basis:
    """Per-layer, per-KV-head rotations of one model's pre-RoPE keys and values.

    ``k``, ``v``: float32 [layers, kv_heads, head_dim, head_dim], row ``i`` of ``[l, h]`` the
    ``i``-th principal direction (largest calibration variance first). ``id``: a digest of
    both tensors' bytes, part of every coded entry's key and meta.
    """

    k: torch.Tensor
    v: torch.Tensor

    @cached_property
    def id(self) -> str:
        h = hashlib.sha256()
        for t in (self.k, self.v):
            h.update(str(tuple(t.shape)).encode())
            h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    @property
    def shape(self) -> tuple[int, int, int]:
        """(layers, kv_heads, head_dim)."""
        layers, heads, dim, _ = self.k.shape
        return int(layers), int(heads), int(dim)


def calibrate(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> Basis:
    """The basis of chunks' K and V, each [layers, kv_heads, tokens, head_dim]: per layer and
    head, the eigenvectors of the centred covariance over every chunk's tokens (float64),
    ordered by eigenvalue (largest first), each signed so its largest entry is positive."""
    return Basis(k=_principal(keys), v=_principal(values))


def _principal(chunks: Sequence[torch.Tensor]) -> torch.Tensor:
    x = torch.cat([c.to("cpu", torch.float64) for c in chunks], dim=2)  # [L, H, T, d]
    x = x - x.mean(dim=2, keepdim=True)
    cov = x.transpose(-1, -2) @ x / max(1, x.shape[2] - 1)
    _, vecs = torch.linalg.eigh(cov)  # ascending eigenvalues, eigenvectors in columns
    rows = vecs.flip(-1).transpose(-1, -2)  # [L, H, d, d], largest first
    pivot = rows.abs().argmax(-1, keepdim=True)
    sign = torch.sign(torch.gather(rows, -1, pivot))
    return (rows * torch.where(sign == 0, 1.0, sign)).to(torch.float32).contiguous()


def budget_bits(bits: float, kv_heads: int, head_dim: int) -> int:
    """Bits a token's codes take per layer and tensor: ``bits`` per value, rounded down to
    whole bytes (at least one)."""
    return max(8, int(bits * kv_heads * head_dim) // 8 * 8)


def bytes_per_token(bits: float, layers: int, kv_heads: int, head_dim: int, tokens: int) -> float:
    """Stored bytes per token of a ``tokens``-token chunk (statistics included)."""
    codes = budget_bits(bits, kv_heads, head_dim) / 8
    stats = 2 * 2 * kv_heads * head_dim / max(1, tokens)
    return 2 * layers * (codes + stats)


def encode_tensor(x: torch.Tensor, rotation: torch.Tensor, bits: float) -> dict[str, torch.Tensor]:
    """One layer's K or V [kv_heads, tokens, head_dim] as ``{"codes", "stats"}`` (see the
    module docstring); ``rotation`` [kv_heads, head_dim, head_dim] from the basis."""
    heads, tokens, dim = x.shape
    y = x.float() @ rotation.transpose(-1, -2)  # [H, T, d] in component coordinates
    mean = y.mean(dim=1)
    std = y.std(dim=1, correction=0) if tokens > 1 else torch.zeros_like(mean)
    stats = torch.stack([mean, std]).to(torch.float16)  # [2, H, d]
    mean, std = stats.float()
    alloc = allocate(std.reshape(-1), budget_bits(bits, heads, dim))  # [H*d]
    flat = (y - mean.unsqueeze(1)).transpose(0, 1).reshape(tokens, heads * dim)  # [T, H*d]
    step, levels = _steps(std.reshape(-1), alloc)
    q = torch.floor(flat / step) + levels / 2
    q = torch.minimum(torch.clamp_min(q, 0), levels - 1).to(torch.uint8)
    return {"codes": _pack(q, alloc).reshape(1, tokens, -1), "stats": stats}


def decode_tensor(
    codes: torch.Tensor, stats: torch.Tensor, rotation: torch.Tensor, bits: float
) -> torch.Tensor:
    """Float32 [kv_heads, tokens, head_dim] from :func:`encode_tensor`'s tensors."""
    heads, dim = int(stats.shape[1]), int(stats.shape[2])
    tokens = int(codes.shape[1])
    mean, std = stats.float()
    alloc = allocate(std.reshape(-1), budget_bits(bits, heads, dim))
    order, counts = _planes(alloc)
    q = _unpack(codes.reshape(tokens, -1), alloc.numel(), counts)  # [T, H*d], packing order
    step, levels = _steps(std.reshape(-1), alloc)
    # a code c of b bits stands for (c - 2**b / 2 + 0.5) * step; components with no bits: 0
    offset = torch.where(alloc > 0, (0.5 - levels / 2) * step, 0.0) + mean.reshape(-1)
    y = torch.addcmul(offset[order], q.float(), step[order])  # packing order
    y = y.index_select(1, torch.argsort(order))  # component order (float: a fast gather)
    return torch.bmm(y.reshape(tokens, heads, dim).transpose(0, 1), rotation)


def allocate(std: torch.Tensor, budget: int) -> torch.Tensor:
    """Bits per component (int64, each 0..8, summing to ``min(budget, 8 * n)``): greedy
    reverse water-filling, each next bit to the component whose error ``σ² · 4**-b`` is
    largest (ties to the lower index; deterministic)."""
    n = std.numel()
    var = std.double() ** 2
    gains = var.unsqueeze(1) * 4.0 ** -torch.arange(MAX_BITS, dtype=torch.float64)  # [n, 8]
    order = torch.sort(-gains.reshape(-1), stable=True).indices[: min(budget, n * MAX_BITS)]
    return torch.bincount(order // MAX_BITS, minlength=n)


def _steps(std: torch.Tensor, alloc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each component's quantizer step (1 where it has no bits) and level count, float32."""
    step = (torch.tensor(STEP, dtype=torch.float32)[alloc] * std).clamp_min(1e-12)
    return torch.where(alloc > 0, step, 1.0), (1 << alloc).to(torch.float32)


def _planes(alloc: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The packing order: components by bits (most first, index order within a count), and
    for each bit plane p the number of components with more than p bits (a prefix of that
    order)."""
    order = torch.sort(-alloc, stable=True).indices
    counts = [int((alloc > p).sum()) for p in range(MAX_BITS)]
    return order, [n for n in counts if n]


def _pack(codes: torch.Tensor, alloc: torch.Tensor) -> torch.Tensor:
    """Each token's stored bits: bit plane 0 of every component with a bit, then plane 1 of
    those with two, … (components in :func:`_planes`' order): uint8 [T, sum(alloc)/8], padded
    with zero bits to whole bytes."""
    order, counts = _planes(alloc)
    q = codes.index_select(1, order)
    planes = [(q[:, :n] >> p) & 1 for p, n in enumerate(counts)]
    kept = torch.cat(planes, dim=1).numpy() if planes else np.zeros((len(q), 0), np.uint8)
    return torch.from_numpy(np.packbits(kept, axis=-1, bitorder="little"))


def _unpack(packed: torch.Tensor, n: int, counts: list[int]) -> torch.Tensor:
    """Codes uint8 [T, n] in :func:`_planes`' order from :func:`_pack`'s bytes (0 for
    components with no bits)."""
    raw = np.unpackbits(packed.numpy(), axis=-1, count=sum(counts), bitorder="little")
    bits = torch.from_numpy(raw)
    q = torch.zeros(packed.shape[0], n, dtype=torch.uint8)
    start = 0
    for p, width in enumerate(counts):
        q[:, :width] |= bits[:, start : start + width] << p
        start += width
    return q
