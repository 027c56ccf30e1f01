"""What the scheduler takes and gives back: a tokenised job, its events, its handle."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from ragblend.decode import BlendStats, SamplingParams, TokenLogprobs
from ragblend.prompt import TokenizedPrompt


@dataclass
class GenerationJob:
    """A tokenised request: a chunked prompt (any mode) or plain ids (full prefill);
    ``params`` holds how it is sampled and when it ends (stop strings, ``ignore_eos``)."""

    prompt: TokenizedPrompt | list[int]
    mode: str
    params: SamplingParams
    max_tokens: int
    fallback_reason: str | None = None  # ragblend.fallback's code: why plain ids run in full
    logprobs: int | None = None  # None: none; n: each token's logprob and the n most likely
    request_id: str = ""
    arrived: float = field(default_factory=time.perf_counter)

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt if isinstance(self.prompt, list) else self.prompt.ids


@dataclass
class Delta:
    """New text, with the logprobs of the tokens handed out since the last delta."""

    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)


@dataclass
class Finished:
    text: str
    finish_reason: str
    stats: BlendStats
    logprobs: list[TokenLogprobs] | None = None  # every generated token's, when asked for


@dataclass
class Failed:
    message: str
    status: int = 500


Event = Delta | Finished | Failed


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full (HTTP 429)."""


class Unavailable(Exception):
    """The server cannot take requests: loading, shutting down, or its compute thread died
    (HTTP 503)."""


class RequestHandle:
    """The event loop's side of one request: its events, and ``cancel()`` to free its slot."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()

    def post(self, event: Event) -> None:
        """Called on the scheduler thread."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is gone: nobody listens any more
            self.cancelled.set()

    async def next_event(self) -> Event:
        return await self._events.get()

    def cancel(self) -> None:
        """The client went away: the request is dropped at the scheduler's next step."""
        self.cancelled.set()
