"""One admitted request on the compute thread: its sampler, decoder, text and logprobs."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ragblend.generation import BlendStats
from ragblend.layer_decode import LayerDecoder
from ragblend.sampling import Sampler, TokenLogprobs, token_logprobs
from ragblend.serving.events import Delta, Finished, GenerationJob, RequestHandle
from ragblend.serving.metrics import ServerMetrics
from ragblend.serving.output import TextOutput


@dataclass
class RunningRequest:
    """A request holding a slot: each chosen token goes through :meth:`accept`."""

    handle: RequestHandle
    job: GenerationJob
    stats: BlendStats
    output: TextOutput
    sampler: Sampler
    eos_ids: set[int]
    metrics: ServerMetrics | None = None
    decoder: LayerDecoder | None = None
    advance: Callable[[int], Any] | None = None  # HF's step where no LayerDecoder applies
    token: int = -1  # the last chosen token, fed at the next step
    done: bool = False
    last_token_at: float = 0.0
    logprobs: list[TokenLogprobs] | None = None  # every token's, when the request asks
    unsent: list[TokenLogprobs] = field(default_factory=list)  # not yet in a Delta

    def __post_init__(self) -> None:
        if self.job.logprobs is not None:
            self.logprobs = []

    def choose(self, logits: torch.Tensor) -> None:
        """Choose the next token from this step's raw ``logits`` and hand it out."""
        self.accept(self.sampler(logits), logits)

    def accept(self, token: int, logits: torch.Tensor) -> None:
        """Hand out ``token``, chosen from ``logits`` (or end the request there)."""
        if not self.job.ignore_eos and token in self.eos_ids:
            self.finish("stop")
            return
        self.stats.completion_tokens += 1
        now = time.perf_counter()
        if self.metrics is not None:
            self.metrics.token(now - self.last_token_at if self.last_token_at else None)
        self.last_token_at = now
        if self.logprobs is not None and self.job.logprobs is not None:
            lp = token_logprobs(logits, token, self.job.logprobs)
            self.logprobs.append(lp)
            self.unsent.append(lp)
        delta = self.output.add(token)
        if delta:
            self.handle.post(Delta(delta, self.unsent))
            self.unsent = []
        if self.output.stopped:
            self.finish("stop")
        elif self.stats.completion_tokens >= self.job.max_tokens:
            self.finish("length")
        else:
            self.token = token

    def finish(self, reason: str) -> None:
        rest = self.output.flush()
        if rest or self.unsent:
            self.handle.post(Delta(rest, self.unsent))
            self.unsent = []
        self.stats.finish_reason = reason
        self.handle.post(Finished(self.output.text, reason, self.stats, self.logprobs))
        if self.metrics is not None:
            self.metrics.finished(self.stats, time.perf_counter() - self.job.arrived)
        self.done = True
        self.decoder = self.advance = None  # frees the K/V buffers now
