"""What the scheduler takes and gives back: a tokenised job, its events, its handle."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

from ragblend.generation import BlendStats, SamplingParams
from ragblend.prompt import TokenizedPrompt


@dataclass
class GenerationJob:
    """A tokenised request: a chunked prompt (any mode) or plain ids (full prefill)."""

    prompt: TokenizedPrompt | list[int]
    mode: str
    params: SamplingParams
    max_tokens: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    fallback_reason: str | None = None  # why plain ids run in full although mode asks more
    arrived: float = field(default_factory=time.perf_counter)

    @property
    def prompt_ids(self) -> list[int]:
        return self.prompt if isinstance(self.prompt, list) else self.prompt.ids


@dataclass
class Delta:
    text: str


@dataclass
class Finished:
    text: str
    finish_reason: str
    stats: BlendStats


@dataclass
class Failed:
    message: str
    status: int = 500


Event = Delta | Finished | Failed


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full."""


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
