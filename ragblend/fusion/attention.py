"""Attention of a subset of query rows over all keys, with an exact causal mask by position."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ragblend.errors import RagblendError

# How selected rows are cut into position-ordered blocks (each block only reads keys up to its
# last row). SDPA's CPU flash kernel splits a call's query rows per head into tiles of 32
# (< 192 rows), 64 (< 768) or 256 rows, and its threads take (head, tile) pairs in turn, so a
# block costs about (tiles per thread) × tile × keys — a 32-row tile measured as slow as a
# 64-row one — plus a fixed cost per call, in the same row·key units (≈ 1 ns each on the
# benchmark CPU; one call ≈ 20 µs). Blocks are chosen to minimise the sum: a staircase close
# to causal attention's, in tiles the kernel fills.
CALL_COST = 20_000
SPLIT_POINTS = 64  # at most this many candidate block boundaries per plan


def query_tile(rows: int) -> int:
    """Query rows per tile of SDPA's CPU flash kernel for a call with ``rows`` rows per head."""
    return 256 if rows >= 768 else 64 if rows >= 192 else 32


def block_cost(rows: int, keys: int, heads: int, threads: int) -> float:
    """Modelled cost of one SDPA call: ``rows`` query rows per head over ``keys`` keys."""
    tile = query_tile(rows)
    tiles = heads * -(-rows // tile)
    return CALL_COST + -(-tiles // threads) * max(tile, 64) * keys


def row_blocks(
    positions: list[int],
    groups: int,
    heads: int,
    threads: int,
    sliding_window: int | None = None,
) -> list[tuple[int, int]]:
    """Split ascending positions into contiguous [start, end) blocks of least total
    :func:`block_cost` (dynamic programming over evenly spaced split points). A block of r
    selected rows is one call with ``groups`` × r query rows for each of ``heads`` KV heads."""
    m = len(positions)
    if m == 0:
        return []
    step = max(1, -(-m // SPLIT_POINTS))
    points = [*range(0, m, step), m]

    def keys(a: int, b: int) -> int:
        start = 0 if sliding_window is None else max(0, positions[a] - int(sliding_window) + 1)
        return positions[b - 1] + 1 - start

    best: dict[int, tuple[float, int]] = {0: (0.0, 0)}
    for j in points[1:]:
        best[j] = min(
            (best[i][0] + block_cost(groups * (j - i), keys(i, j), heads, threads), i)
            for i in points
            if i < j
        )
    bounds = [m]
    while bounds[-1]:
        bounds.append(best[bounds[-1]][1])
    bounds.reverse()
    return list(zip(bounds, bounds[1:]))


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


class RowAttentionPlan:
    """Blocks and additive masks for one set of query positions, reused across layers.

    The selected rows only change at check layers, so masks are built once per selection
    (and sliding window) instead of once per layer. Given ``num_keys`` (the prompt length),
    rows that end the prompt contiguously get no masks: they take the causal path.
    """

    def __init__(
        self,
        positions: torch.Tensor,
        groups: int,
        dtype: torch.dtype,
        sliding_window: int | None,
        num_keys: int | None = None,
        kv_heads: int = 1,
    ) -> None:
        pos = positions.tolist()
        self.num_rows = len(pos)
        # Rows P, P+1, …, P+m-1 with no window: when they end the prompt, SDPA's causal
        # kernel (queries padded with P dummy rows) is faster than masked blocks.
        contiguous = bool(pos) and pos[-1] - pos[0] + 1 == len(pos)
        self.causal_start = pos[0] if contiguous and sliding_window is None else None
        self.blocks: list[tuple[int, int, int, int, torch.Tensor]] = []
        self.num_keys = num_keys
        self.causal_only = self.causal_start is not None and num_keys == pos[-1] + 1
        if self.causal_only:
            return  # attend_rows takes the causal path for these keys: no masks needed
        # On a GPU every tile runs at once: one "thread" makes the cost the block's area.
        threads = torch.get_num_threads() if positions.device.type == "cpu" else 1
        for a, b in row_blocks(pos, groups, kv_heads, threads, sliding_window):
            end = pos[b - 1] + 1
            start = 0 if sliding_window is None else max(0, pos[a] - int(sliding_window) + 1)
            allowed = position_mask(positions[a:b], end - start, sliding_window, key_start=start)
            bias = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
            bias.masked_fill_(~allowed, float("-inf"))
            bias = (
                bias.unsqueeze(0).expand(groups, b - a, end - start).reshape(groups * (b - a), -1)
            )
            self.blocks.append((a, b, start, end, bias))


def attend_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RowAttentionPlan, scaling: float
) -> torch.Tensor:
    """Attention for the plan's query rows over keys 0…N-1 → [1, m, H*d].

    q [1, H, m, d]; k, v [1, Hkv, N, d]. GQA is handled by folding each KV head's group of
    query heads into the row axis (no K/V copies); rows are processed in position-ordered
    blocks so a block never reads keys past its last row.
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
