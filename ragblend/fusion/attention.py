"""Attention of a subset of query rows over all keys, with an exact causal mask by position."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def position_mask(
    query_positions: torch.Tensor, num_keys: int, sliding_window: int | None = None
) -> torch.Tensor:
    """Boolean [m, N] mask: query at original position p may see key j iff j <= p.

    Built from the queries' original positions, not aligned to the bottom-right corner, so a
    selected early token never sees later keys. With a sliding window W, also j > p - W
    (HF's convention).
    """
    keys = torch.arange(num_keys, device=query_positions.device)
    q = query_positions.view(-1, 1)
    mask = keys.view(1, -1) <= q
    if sliding_window is not None:
        mask &= keys.view(1, -1) > q - int(sliding_window)
    return mask


def attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
) -> torch.Tensor:
    """SDPA for q [1, H, m, d] over k, v [1, Hkv, N, d] (GQA-aware) → [1, m, H*d].

    ``mask=None`` means plain causal attention with m == N.
    """
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    if mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).reshape(1, q.shape[2], -1)
