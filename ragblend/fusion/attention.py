"""Attention of a subset of query rows over all keys, with an exact causal mask by position."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ragblend.errors import RagblendError
from ragblend.kernels import RowKernel

# Selected rows are split into this many position-ordered blocks at most; each block only
# reads keys up to its last row's position, which recovers most of causal attention's saving.
MAX_BLOCKS = 16
MIN_BLOCK_ROWS = 96


def position_mask(
    query_positions: torch.Tensor,
    num_keys: int,
    sliding_window: int | None = None,
    key_start: int = 0,
) -> torch.Tensor:
    """Boolean [m, K] mask: query at original position p may see key j iff j <= p.

    Built from the queries' original positions, not aligned to the bottom-right corner, so a
    selected early token never sees later keys. With a sliding window W, also j > p - W
    (HF's convention). Keys are positions ``key_start … key_start + num_keys - 1``.
    """
    keys = torch.arange(key_start, key_start + num_keys, device=query_positions.device)
    q = query_positions.view(-1, 1)
    mask = keys.view(1, -1) <= q
    if sliding_window is not None:
        mask &= keys.view(1, -1) > q - int(sliding_window)
    return mask


def row_blocks(positions: list[int], max_blocks: int = MAX_BLOCKS) -> list[tuple[int, int]]:
    """Split ascending positions into contiguous [start, end) blocks of similar size."""
    m = len(positions)
    count = max(1, min(max_blocks, m // MIN_BLOCK_ROWS))
    bounds = [round(i * m / count) for i in range(count + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


class RowAttentionPlan:
    """Blocks and additive masks for one set of query positions, reused across layers.

    The selected rows only change at check layers, so masks are built once per selection
    (and sliding window) instead of once per layer. Given ``num_keys`` (the prompt length),
    rows that end the prompt contiguously get no masks: they take the causal path. Given a
    native ``kernel`` (:mod:`ragblend.kernels.cpu.native`) and no sliding window, other row sets
    get no masks either: the kernel reads each row's own keys; and with ``exact_causal``
    off it takes rows that end the prompt too (4.5x SDPA's causal kernel in bf16 on a CPU
    without AMX, 1.1x in fp32), which ``exact_causal`` keeps on SDPA's causal kernel: the
    one HF's full prefill runs, so that a recompute of every row equals it.

    The rows' positions are read on the host (``host_positions`` where the caller has them;
    else from ``positions``: a device sync on a GPU), except with ``device_masks`` and no host
    positions: then every row goes in one block over all keys with a mask built on the device
    (one SDPA call per layer; what a GPU runs after a selection).
    """

    def __init__(
        self,
        positions: torch.Tensor,
        groups: int,
        dtype: torch.dtype,
        sliding_window: int | None,
        num_keys: int | None = None,
        kernel: RowKernel | None = None,
        exact_causal: bool = True,
        host_positions: Sequence[int] | None = None,
        device_masks: bool = False,
    ) -> None:
        if sliding_window is not None and num_keys is not None and sliding_window >= num_keys:
            sliding_window = None  # a window as long as the prompt masks nothing
        self.num_keys = num_keys
        self.positions = positions.contiguous()
        if host_positions is None and device_masks:
            self._one_block(positions, groups, dtype, sliding_window, kernel)
            return
        pos = list(host_positions) if host_positions is not None else positions.tolist()
        self.num_rows = len(pos)
        # Rows P, P+1, …, P+m-1 with no window: when they end the prompt, SDPA's causal
        # kernel (queries padded with P dummy rows) is faster than masked blocks.
        contiguous = bool(pos) and pos[-1] - pos[0] + 1 == len(pos)
        if kernel is not None and not exact_causal:
            contiguous = False  # the kernel is faster: rows ending the prompt go to it too
        self.causal_start = pos[0] if contiguous and sliding_window is None else None
        self.blocks: list[tuple[int, int, int, int, torch.Tensor]] = []
        self.causal_only = self.causal_start is not None and num_keys == pos[-1] + 1
        self.kernel = kernel if sliding_window is None and not self.causal_only else None
        if self.causal_only or self.kernel is not None:
            return  # attend_rows takes the causal path or the kernel: no masks needed
        for a, b in row_blocks(pos):
            end = pos[b - 1] + 1
            start = 0 if sliding_window is None else max(0, pos[a] - int(sliding_window) + 1)
            allowed = position_mask(positions[a:b], end - start, sliding_window, key_start=start)
            bias = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
            bias.masked_fill_(~allowed, float("-inf"))
            bias = (
                bias.unsqueeze(0).expand(groups, b - a, end - start).reshape(groups * (b - a), -1)
            )
            self.blocks.append((a, b, start, end, bias))

    def _one_block(
        self,
        positions: torch.Tensor,
        groups: int,
        dtype: torch.dtype,
        sliding_window: int | None,
        kernel: RowKernel | None,
    ) -> None:
        """Every row in one block over all keys, its mask built on the device from the rows'
        positions (never read on the host): one SDPA call per layer, no host sync."""
        if self.num_keys is None:
            raise RagblendError("a plan with device masks needs the number of keys")
        m = self.num_rows = int(positions.numel())
        self.causal_start, self.causal_only = None, False
        self.kernel = kernel if sliding_window is None else None
        self.blocks = []
        if self.kernel is not None:
            return
        allowed = position_mask(positions, self.num_keys, sliding_window)
        bias = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
        bias.masked_fill_(~allowed, float("-inf"))
        bias = bias.unsqueeze(0).expand(groups, m, self.num_keys).reshape(groups * m, -1)
        self.blocks.append((0, m, 0, self.num_keys, bias))


def attend_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RowAttentionPlan, scaling: float
) -> torch.Tensor:
    """Attention for the plan's query rows over keys 0…N-1 → [1, m, H*d].

    q [1, H, m, d]; k, v [1, Hkv, N, d]. GQA is handled by folding each KV head's group of
    query heads into the row axis (no K/V copies); rows are processed in position-ordered
    blocks so a block never reads keys past its last row, or by the plan's native kernel.
    """
    _, heads, m, dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    start = plan.causal_start
    if start is not None and start + m == k.shape[2]:
        if start:
            q = torch.cat([q.new_zeros(1, heads, start, dim), q], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, enable_gqa=groups > 1
        )[:, :, start:]
        return out.transpose(1, 2).reshape(1, m, heads * dim)
    if plan.kernel is not None:
        return plan.kernel(q, k, v, plan.positions, scaling)
    if plan.causal_only:
        raise RagblendError(f"attention plan built for {plan.num_keys} keys, got {k.shape[2]}")
    q = q.reshape(1, kv_heads, groups, m, dim)
    outs = []
    for a, b, start, end, bias in plan.blocks:
        rows = b - a
        qb = q[:, :, :, a:b].reshape(1, kv_heads, groups * rows, dim)
        out = F.scaled_dot_product_attention(
            qb, k[:, :, start:end], v[:, :, start:end], attn_mask=bias, scale=scaling
        )
        outs.append(out.view(1, kv_heads, groups, rows, dim))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=3)
    return out.reshape(1, heads, m, dim).transpose(1, 2).reshape(1, m, heads * dim)
