"""One admitted request on the compute thread: its decode state, decoder and logprobs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ragblend.decode import (
    BlendStats,
    DecodeState,
    HFDecoder,
    LayerDecoder,
    TokenLogprobs,
    token_logprobs,
)
from ragblend.serving.events import Delta, Finished, GenerationJob, RequestHandle
from ragblend.serving.metrics import ServerMetrics


@dataclass
class RunningRequest:
    """A request holding a slot: each step's logits go through :meth:`choose`; its
    :class:`~ragblend.decode.loop.DecodeState` says what to send and when the answer ends."""

    handle: RequestHandle
    job: GenerationJob
    stats: BlendStats
    state: DecodeState
    metrics: ServerMetrics | None = None
    decoder: LayerDecoder | HFDecoder | None = None  # None once done (frees the K/V buffers)
    done: bool = False
    last_token_at: float = 0.0
    logprobs: list[TokenLogprobs] | None = None  # every token's, when the request asks
    unsent: list[TokenLogprobs] = field(default_factory=list)  # not yet in a Delta

    def __post_init__(self) -> None:
        if self.job.logprobs is not None:
            self.logprobs = []

    @property
    def token(self) -> int:
        """The last token of the answer, fed at the next step."""
        return self.state.token_ids[-1]

    def choose(self, logits: torch.Tensor, argmax: int | None = None) -> None:
        """Choose the next token from this step's raw ``logits`` and hand it out; ``argmax``:
        their argmax where the step took it for the batch."""
        self.accept(self.state.sample(logits, argmax), logits)

    def accept(self, token: int, logits: torch.Tensor) -> None:
        """Hand out ``token``, chosen from ``logits`` (or end the request there)."""
        kept = len(self.state.token_ids)
        delta = self.state.add(token)
        if len(self.state.token_ids) > kept:  # not the end-of-sequence token that ended it
            self.stats.completion_tokens += 1
            now = time.perf_counter()
            if self.metrics is not None:
                self.metrics.token(now - self.last_token_at if self.last_token_at else None)
            self.last_token_at = now
            if self.logprobs is not None and self.job.logprobs is not None:
                lp = token_logprobs(logits, token, self.job.logprobs)
                self.logprobs.append(lp)
                self.unsent.append(lp)
        if delta or (self.state.done and self.unsent):
            self.handle.post(Delta(delta, self.unsent))
            self.unsent = []
        if self.state.done:
            self._finished()

    def _finished(self) -> None:
        reason = self.state.finish_reason or "stop"
        self.stats.finish_reason = reason
        self.handle.post(Finished(self.state.text, reason, self.stats, self.logprobs))
        if self.metrics is not None:
            self.metrics.finished(self.stats, time.perf_counter() - self.job.arrived)
        self.done = True
        self.decoder = None  # frees the K/V buffers now
