"""Waiting on a request's events: non-streaming answers and server-sent events.

Both give up at the request's deadline (``ragblend serve --timeout``): the request is
cancelled (its slot freed at the scheduler's next step) and answered with an error. A stream
sends a ``: keep-alive`` comment whenever no event came for ``keepalive_s`` (a request waiting
in the queue or prefilling), so proxies and clients with read timeouts keep the connection.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from ragblend.serving import protocol as p
from ragblend.serving.events import Delta, Event, Failed, Finished, RequestHandle
from ragblend.serving.metrics import ServerMetrics

KEEPALIVE = ": keep-alive\n\n"
TIMEOUT_STATUS = 408


class TimedOut:
    """The request's deadline passed before its next event."""


@dataclass
class Waiter:
    """How one request waits: its ``deadline`` (a perf_counter value, or None)."""

    handle: RequestHandle
    deadline: float | None = None

    def left(self, at_most: float) -> float:
        if self.deadline is None:
            return at_most
        return max(0.0, min(at_most, self.deadline - time.perf_counter()))

    def expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    async def next(self, wait_s: float) -> Event | None:
        """The next event, or None after ``wait_s`` (or at the deadline) without one."""
        try:
            return await asyncio.wait_for(self.handle.next_event(), self.left(wait_s))
        except asyncio.TimeoutError:
            return None

    async def event_or_gone(self, request: Request, poll_s: float = 0.5) -> Event | TimedOut | None:
        """The next event; None when the client went away, TimedOut at the deadline."""
        while True:
            event = await self.next(poll_s)
            if event is not None:
                return event
            if self.expired():
                return TimedOut()
            if await request.is_disconnected():
                return None


def timeout_message(timeout_s: float | None) -> str:
    return f"the request did not finish within the server's timeout ({timeout_s:g} s)"


async def sse(
    waiter: Waiter,
    chunk: Callable[..., dict],
    final: Callable[[Finished], list[dict]],
    logprobs: Callable[[list], dict | None],
    metrics: ServerMetrics,
    keepalive_s: float,
    timeout_s: float | None,
    first: dict | None = None,
) -> AsyncIterator[str]:
    """Server-sent events of one request, ending ``data: [DONE]``.

    ``chunk(text, finish=None, logprobs=None)``: one data event's body; ``final(finished)``:
    the last events (they carry ``ragblend``, and ``usage`` when asked); ``logprobs(items)``:
    a delta's logprobs in the endpoint's shape (None when not asked); ``first``: an event to
    send before anything else (chat's role).
    """

    def event(data: dict) -> str:
        return f"data: {json.dumps(data)}\n\n"

    def failure(status: int, message: str, code: str | None = None) -> str:
        metrics.error(status)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return event(p.error_body(message, kind, code=code))

    try:
        if first is not None:
            yield event(first)
        while True:
            ev = await waiter.next(keepalive_s)
            if ev is None:
                if waiter.expired():
                    yield failure(TIMEOUT_STATUS, timeout_message(timeout_s), "request_timeout")
                    break
                yield KEEPALIVE
            elif isinstance(ev, Delta):
                yield event(chunk(ev.text, logprobs=logprobs(ev.logprobs)))
            elif isinstance(ev, Failed):
                yield failure(ev.status, ev.message)
                break
            elif isinstance(ev, Finished):
                for body in final(ev):
                    yield event(body)
                break
        yield "data: [DONE]\n\n"
    finally:  # also when the client disconnects (the response task is cancelled)
        waiter.handle.cancel()


def usage_events(
    chunk: Callable[..., dict], finished: Finished, info: dict, include_usage: bool
) -> list[dict]:
    """The last data events of a stream: the finish reason, ``ragblend`` and maybe ``usage``."""
    if not include_usage:
        return [chunk("", finished.finish_reason, ragblend=info)]
    usage = p.Usage.of(finished.stats).model_dump()
    last: dict[str, Any] = {**chunk("", finished.finish_reason), "choices": [], "usage": usage}
    return [chunk("", finished.finish_reason), {**last, "ragblend": info}]
