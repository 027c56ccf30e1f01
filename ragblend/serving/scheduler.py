"""Per-step scheduling of generation requests on one engine (the server's compute thread).

Like llama.cpp's server, a fixed number of *slots* run at once. One thread does every torch
computation of the server (one OpenMP team, see ``ragblend.threads``), in a loop of steps:

1. requests whose client went away are dropped (their slot and K/V buffer are freed);
2. one queued call runs (e.g. precomputing one chunk for ``POST /v1/ragblend/chunks``, or
   one that a prefill missed: :meth:`Scheduler.rewarm`);
3. one waiting request is admitted into a free slot: its prefill (blend makes it short) runs
   and its first token is sent;
4. every running request decodes one token, all as one batch
   (:func:`ragblend.decode.decoder.decode_batch`: one GEMM per linear over all their rows,
   attention per request over its own cache); the greedy requests' tokens are chosen by one
   argmax over their rows (:func:`ragblend.decode.sampling.greedy_choices`), the others' each by
   its own sampler.

So a new request waits at most one decode step for its prefill, and running requests pause
for at most one prefill. The waiting queue is bounded: :meth:`Scheduler.submit` raises
:class:`QueueFull` (HTTP 429) when it is full, and :class:`Unavailable` (HTTP 503) when the
loop is not running (not started yet, shutting down, or stopped by an error).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ragblend.decode import (
    BlendStats,
    DecodeState,
    HFDecoder,
    LayerDecoder,
    Prefill,
    decode_batch,
    greedy_choices,
)
from ragblend.engine import BlendEngine
from ragblend.errors import RagblendError
from ragblend.fallback import fall_back
from ragblend.serving.events import Failed, GenerationJob, QueueFull, RequestHandle, Unavailable
from ragblend.serving.jobs import NO_CHUNK
from ragblend.serving.metrics import ServerMetrics
from ragblend.serving.running import RunningRequest

log = logging.getLogger(__name__)


class Scheduler:
    """Runs generation jobs on ``engine`` in ``max_running`` slots (see the module docstring)."""

    def __init__(
        self,
        engine: BlendEngine,
        max_running: int = 8,
        max_queue: int = 64,
        metrics: ServerMetrics | None = None,
    ) -> None:
        if max_running < 1 or max_queue < 0:
            raise RagblendError("max_running must be >= 1 and max_queue >= 0")
        self.engine = engine
        self.max_running = max_running
        self.max_queue = max_queue
        self.metrics = metrics
        self._cond = threading.Condition()
        self._waiting: collections.deque[tuple[RequestHandle, GenerationJob]] = collections.deque()
        self._calls: collections.deque[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            collections.deque()
        )
        self._running: list[RunningRequest] = []
        self._rewarming: set[str] = set()  # chunk texts queued by rewarm, until precomputed
        self._stopping = False
        self._in_hand: tuple[Any, Any] = (None, None)  # popped this step, not yet handled
        self._alive = False  # the loop runs (or is about to, on start() / run())
        self.failure: BaseException | None = None  # what stopped the loop, if anything did
        self.largest_batch = 0  # the most requests one decode step has run together
        self._thread = threading.Thread(target=self._loop, name="ragblend-scheduler", daemon=True)

    # ------------------------------------------------------------------ the event loop's side
    def open(self) -> None:
        """Take requests from now on (they wait in the queue until the loop runs)."""
        self._alive = True

    def start(self) -> None:
        """Run the loop on a thread of its own."""
        self.open()
        self._thread.start()

    def run(self) -> None:
        """Run the loop on the calling thread until :meth:`stop` (``ragblend serve`` runs it on
        the thread that loaded the model: one OpenMP team in the process). Raises what
        stopped it, if an error did (requests in flight get 503 first)."""
        self.open()
        self._loop()
        if self.failure is not None:
            raise RagblendError(f"the scheduler stopped: {self.failure}") from self.failure

    @property
    def alive(self) -> bool:
        """The loop takes requests (False before start, after stop, or after an error)."""
        return self._alive and not self._stopping

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def rewarming(self) -> int:
        """Chunk texts queued by :meth:`rewarm` and not yet precomputed."""
        return len(self._rewarming)

    def submit(self, job: GenerationJob, loop: asyncio.AbstractEventLoop) -> RequestHandle:
        """Queue ``job``; raises QueueFull when the waiting queue is full, Unavailable when
        the loop does not run."""
        handle = RequestHandle(loop)
        with self._cond:
            self._check_alive()
            in_flight = len(self._running) + len(self._waiting)
            if in_flight >= self.max_running + self.max_queue:
                raise QueueFull(
                    f"{len(self._running)} requests are running and {len(self._waiting)} wait"
                )
            self._waiting.append((handle, job))
            self._cond.notify()
        self._gauges()
        return handle

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the compute thread between two steps; its future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._check_alive()
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def rewarm(self, texts: list[str]) -> None:
        """Queue a precompute of each chunk text a prefill found but missed in the store (its
        KV evicted, expired or lost), one per step, so later requests hit it; a text already
        queued is not queued twice. The engine's ``on_miss`` hook in a server."""
        for text in texts:
            if text in self._rewarming:
                continue
            try:
                future = self.call(functools.partial(self.engine.precompute, [text]))
            except Unavailable:  # shutting down
                return
            self._rewarming.add(text)
            future.add_done_callback(functools.partial(self._rewarmed, text))

    def _rewarmed(self, text: str, _future: concurrent.futures.Future) -> None:
        self._rewarming.discard(text)

    def _check_alive(self) -> None:
        if self._stopping or not self._alive:
            what = "stopped after an error" if self.failure else "is shutting down or starting"
            raise Unavailable(f"the server {what}; retry later")

    # ------------------------------------------------------------------ the compute thread
    def _loop(self) -> None:
        try:
            self._steps()
        except Exception as exc:  # the thread dies: say so, and fail what is in flight
            log.exception("the scheduler loop stopped")
            self.failure = exc
        finally:
            self._alive = False
            self._shut_down()

    def _steps(self) -> None:
        self.engine.prepare_decode()
        while True:
            with self._cond:
                while not (self._stopping or self._waiting or self._running or self._calls):
                    self._cond.wait()
                if self._stopping:
                    break
                call = self._calls.popleft() if self._calls else None
                admit = None
                if self._waiting and len(self._running) < self.max_running:
                    admit = self._waiting.popleft()
                self._in_hand = (call, admit)  # failed by _shut_down if this step dies
            self._drop_cancelled()
            if call is not None:
                self._run_call(*call)
            if admit is not None and not admit[0].cancelled.is_set():
                self._admit(*admit)
            self._in_hand = (None, None)
            if self._running:
                self._step()
            self._gauges()

    def _run_call(self, fn: Callable[[], Any], future: concurrent.futures.Future) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the caller
            future.set_exception(exc)

    def _drop_cancelled(self) -> None:
        for r in self._running:
            if r.handle.cancelled.is_set():
                r.done = True
                log.info("request %s: cancelled (client gone or timed out)", r.job.request_id)
                if self.metrics is not None:
                    self.metrics.cancelled.inc()
        self._running = [r for r in self._running if not r.done]

    def _prefill(self, job: GenerationJob) -> Prefill:
        if isinstance(job.prompt, list):
            stats = BlendStats(mode="full", prompt_tokens=len(job.prompt))
            if job.fallback_reason is not None:
                fall_back(stats, job.fallback_reason, NO_CHUNK)
            return self.engine.full_prefill(job.prompt, stats)
        return self.engine.prefill(job.prompt, mode=job.mode)

    def _admit(self, handle: RequestHandle, job: GenerationJob) -> None:
        try:
            pre = self._prefill(job)
            engine = self.engine
            eos, tokenizer = engine.eos_ids, engine.tokenizer
            state = DecodeState(job.params, eos, job.max_tokens, tokenizer, job.prompt_ids)
            first = state.sample(pre.logits)
            stats = pre.stats
            stats.ttft_ms = (time.perf_counter() - job.arrived) * 1000
            r = RunningRequest(handle, job, stats, state, self.metrics)
            if job.max_tokens > 1:
                r.decoder = engine.decoder(pre, job.max_tokens)
        except RagblendError as exc:
            handle.post(Failed(str(exc), 400))
            return
        except Exception as exc:
            log.exception("request %s: prefill failed", job.request_id)
            handle.post(Failed(f"prefill failed: {exc}", 500))
            return
        if self.metrics is not None:
            self.metrics.first_token(stats)
        self._running.append(r)
        r.accept(first, pre.logits)

    def _step(self) -> None:
        batch = [r for r in self._running if isinstance(r.decoder, LayerDecoder)]
        solo = [r for r in self._running if isinstance(r.decoder, HFDecoder)]
        t0 = time.perf_counter()
        self.largest_batch = max(self.largest_batch, len(batch))
        try:
            if batch:
                decoders = [r.decoder for r in batch if isinstance(r.decoder, LayerDecoder)]
                logits = decode_batch(decoders, [r.token for r in batch])
                greedy = greedy_choices(logits, [r.state.plain_greedy for r in batch])
                for r, row, argmax in zip(batch, logits, greedy):
                    r.choose(row, argmax)
            for r in solo:
                if r.decoder is not None:
                    r.choose(r.decoder.step(r.token))
        except Exception as exc:
            log.exception("decode step failed")
            for r in batch + solo:
                if not r.done:
                    r.handle.post(Failed(f"decoding failed: {exc}", 500))
                    r.done = True
        if self.metrics is not None:
            self.metrics.decoded(len(batch) + len(solo), time.perf_counter() - t0)
        self._running = [r for r in self._running if not r.done]

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.occupancy(len(self._waiting), len(self._running))

    def _shut_down(self) -> None:
        with self._cond:
            call, admit = self._in_hand
            waiting, self._waiting = list(self._waiting), collections.deque()
            calls, self._calls = list(self._calls), collections.deque()
            waiting += [admit] if admit is not None else []
            calls += [call] if call is not None else []
        why = "the server is shutting down"
        if self.failure is not None:
            why = f"the server's compute loop stopped: {self.failure}"
        for handle, _ in waiting:
            handle.post(Failed(why, 503))
        for r in self._running:
            r.handle.post(Failed(why, 503))
        self._running = []
        for _, future in calls:
            if not future.done():
                future.set_exception(Unavailable(why))
