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

    @property
    def fits(self) -> bool: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class PromptRows:
    """Per-row facts of a prompt of N tokens, on the compute device.

    ``cached``/``exact``/``forced`` are bool [N]: a row has stored KV; its KV equals full
    prefill (exact prefix cache, never recomputed); it must be recomputed (no cache, or the
    last row, whose logits give the first token). ``candidates`` [C] are the positions that may
    be recomputed (not exact), ascending; ``forced_rows`` [F] the forced positions, ascending.
    ``offsets`` [N] is each row's index within its segment (0 at a chunk's first token).
    ``question_start`` is the first row of the uncached tail (what query-aware selectors ask
    about); ``num_approx`` counts cached, non-exact rows (the budget base of a recompute
    ratio), ``num_uncached`` the rows without a cache.

    Everything is built on the host and uploaded at once (one copy per dtype): the counts and
    the host lists ``candidate_list``/``forced_list``/``offset_list`` size every selection
    without reading the device back (no host sync on a GPU). ``fitted_list`` (host, [N]): the
    row's segment ``fits`` (its cache was precomputed after the chunk before it).
    """

    ids: torch.Tensor
    cached: torch.Tensor
    exact: torch.Tensor
    forced: torch.Tensor
    candidates: torch.Tensor
    question_start: int
    num_approx: int
    offsets: torch.Tensor
    forced_rows: torch.Tensor
    num_uncached: int
    candidate_list: list[int]
    forced_list: list[int]
    offset_list: list[int]
    fitted_list: list[bool]

    @property
    def n(self) -> int:
        return int(self.ids.numel())


def prompt_rows(segments: Sequence[HasCache], device: torch.device | str) -> PromptRows:
    """The :class:`PromptRows` of ``segments`` concatenated in order."""
    ids = [t for s in segments for t in s.ids]
    n = len(ids)
    cached: list[bool] = []
    exact: list[bool] = []
    offsets: list[int] = []
    fitted: list[bool] = []
    for seg in segments:
        cached += [seg.kv is not None] * len(seg)
        exact += [seg.kv is not None and seg.exact] * len(seg)
        offsets += range(len(seg))
        fitted += [seg.kv is not None and seg.fits] * len(seg)
    forced = [not c for c in cached]
    forced[n - 1] = True
    candidates = [i for i in range(n) if not exact[i]]
    forced_list = [i for i in range(n) if forced[i]]
    last = segments[-1]
    question_start = n - (len(last) if last.kv is None else 1)
    device = torch.device(device)
    longs = upload(torch.tensor(ids + offsets + candidates + forced_list), device)
    flags = upload(torch.tensor(cached + exact + forced), device)
    num_candidates = len(candidates)
    return PromptRows(
        ids=longs[:n],
        cached=flags[:n],
        exact=flags[n : 2 * n],
        forced=flags[2 * n :],
        candidates=longs[2 * n : 2 * n + num_candidates],
        question_start=question_start,
        num_approx=sum(has and not same for has, same in zip(cached, exact, strict=True)),
        offsets=longs[n : 2 * n],
        forced_rows=longs[2 * n + num_candidates :],
        num_uncached=n - sum(cached),
        candidate_list=candidates,
        forced_list=forced_list,
        offset_list=offsets,
        fitted_list=fitted,
    )


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``: one copy, from pinned memory on a GPU (no wait for it)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
