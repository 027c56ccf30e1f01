"""Row bookkeeping of a fused prompt: which rows are cached, exact, forced, candidates."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class HasCache(Protocol):
    @property
    def ids(self) -> list[int]: ...

    @property
    def kv(self) -> object | None: ...

    @property
    def exact(self) -> bool: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class PromptRows:
    """Per-row facts of a prompt of N tokens, on the compute device.

    ``cached``/``exact``/``forced`` are bool [N]: a row has stored KV; its KV equals full
    prefill (exact prefix cache, never recomputed); it must be recomputed (no cache, or the
    last row, whose logits give the first token). ``candidates`` [C] are the positions that may
    be recomputed (not exact), ascending. ``offsets`` [N] is each row's index within its
    segment (0 at a chunk's first token). ``question_start`` is the first row of the uncached
    tail (what query-aware selectors ask about); ``num_approx`` counts cached, non-exact rows
    (the budget base of a recompute ratio).
    """

    ids: torch.Tensor
    cached: torch.Tensor
    exact: torch.Tensor
    forced: torch.Tensor
    candidates: torch.Tensor
    question_start: int
    num_approx: int
    offsets: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.ids.numel())


def prompt_rows(segments: Sequence[HasCache], device: torch.device | str) -> PromptRows:
    """The :class:`PromptRows` of ``segments`` concatenated in order."""
    ids = torch.tensor([t for s in segments for t in s.ids], device=device, dtype=torch.long)
    n = ids.numel()
    cached = torch.zeros(n, dtype=torch.bool, device=device)
    exact = torch.zeros(n, dtype=torch.bool, device=device)
    offsets = torch.zeros(n, dtype=torch.long, device=device)
    start = 0
    for seg in segments:
        cached[start : start + len(seg)] = seg.kv is not None
        exact[start : start + len(seg)] = seg.kv is not None and seg.exact
        offsets[start : start + len(seg)] = torch.arange(len(seg), device=device)
        start += len(seg)
    forced = ~cached
    forced[n - 1] = True
    last = segments[-1]
    question_start = n - (len(last) if last.kv is None else 1)
    return PromptRows(
        ids=ids,
        cached=cached,
        exact=exact,
        forced=forced,
        candidates=(~exact).nonzero().squeeze(1),
        question_start=question_start,
        num_approx=int((cached & ~exact).sum()),
        offsets=offsets,
    )
