"""Background KV precompute: one deduplicating, prioritised pool with worker threads.

Every integration (LlamaIndex ``BlendLLM``, LangChain ``ChatRagBlend``, the ``ragblend warmup``
command) uses this pool: items are chunk texts (or token ids) tagged with the prompt layout
they are precomputed under, so one pool serves every layout. Retrieval-time misses
(``priority=RETRIEVAL``) go before the ingestion backlog (``priority=BACKLOG``), and workers
pause while a query runs (:meth:`WarmupPool.query`): no new item starts, and an item already
started stops before its next layer and goes back to the queue, so background warmup does not
compete with a running prefill/decode for the CPU. Each item is computed on a thread of its own
that ends with it: a parked thread that has computed would slow every later query in the process
(:mod:`ragblend.threads`). ``benchmarks/serving/warmup_interference.py`` measures both.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from ragblend.engine import BlendEngine
from ragblend.matching import known_chunks
from ragblend.prompt import PromptFormat, encode
from ragblend.threads import call_in_fresh_thread

log = logging.getLogger(__name__)
RETRIEVAL = 0  # a chunk a query just retrieved and missed: the next query wants it
BACKLOG = 1  # ingestion-time warmup
_STOP_PRIORITY = 2  # after every real item
_STOP = object()
Item = str | tuple[int, ...]


class _Preempted(Exception):
    """A query started: the item stops before its next layer and goes back to the queue."""


class _Precomputing:
    """What both warmup workers share: precompute one item, count it, report the outcome.

    Subclasses set ``engine``, ``on_done``, ``_lock`` and the counters ``stored``,
    ``skipped``, ``errors`` before their workers start.
    """

    engine: BlendEngine
    on_done: Callable[[bool], None] | None
    _lock: threading.Lock
    stored: int
    skipped: int
    errors: list[str]

    def _precompute_one(self, item: Item, head: list[int]) -> bool:
        """Precompute ``item`` (text or token ids) after ``head``; True if newly stored.

        Failures are logged and kept in ``errors``, never raised: the worker must live on.
        """
        try:
            ids = list(item) if isinstance(item, tuple) else encode(self.engine.tokenizer, item)
            args: list = [ids, head, self._between_layers()]
            if isinstance(item, str):  # its neighbours: those its engine knows by now
                neighbours = self.engine.neighbour_ids(item)
                if neighbours:
                    args.append(neighbours)
            stored = call_in_fresh_thread(
                self.engine.precompute_ids, *args, name="ragblend-warmup-compute"
            )
            if isinstance(item, str):  # known to every engine on the store from now on
                self.engine.chunks.record_texts([(item, ids)], head)
        except _Preempted:
            raise
        except Exception as exc:
            log.warning("warmup of a chunk failed: %s", exc)
            with self._lock:
                self.errors.append(str(exc))
            return False
        with self._lock:  # several workers update the counters
            if stored:
                self.stored += 1
            else:
                self.skipped += 1
        return stored

    def _between_layers(self) -> Callable[[], None] | None:
        """What a precompute calls before each layer (None: nothing, run through)."""
        return None

    def _notify_done(self, stored: bool) -> None:
        if self.on_done is not None:
            try:
                self.on_done(stored)
            except Exception as exc:  # a progress callback must not kill the worker
                log.debug("warmup on_done callback failed: %s", exc)


class WarmupPool(_Precomputing):
    """Precomputes chunks in the background so later queries hit the KV store.

    ``warm`` never blocks the caller for long: duplicates (queued under the same layout) are
    dropped and, when ``max_pending`` items wait, new ones are counted as ``dropped``
    (``block=True`` waits for room instead, for batch jobs). ``on_done(stored)`` is called
    after each item (False: already stored or failed), e.g. to drive a progress bar.
    """

    def __init__(
        self,
        engine: BlendEngine,
        workers: int = 1,
        max_pending: int = 10_000,
        on_done: Callable[[bool], None] | None = None,
        pause_during_queries: bool = True,
    ) -> None:
        self.engine = engine
        self.on_done = on_done
        self.pause_during_queries = pause_during_queries
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._room = threading.Semaphore(max_pending)
        self._seq = itertools.count()
        self._pending: set[tuple[tuple[int, ...], Item]] = set()
        self._heads: dict[tuple[int, ...], list[int]] = {}  # the engine's own head lists
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no query runs
        self._active_queries = 0
        self._closed = False
        self.stored = 0
        self.skipped = 0
        self.dropped = 0
        self.preempted = 0  # items stopped mid-way by a query and queued again
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._work, name=f"ragblend-warmup-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ submit
    def warm(
        self,
        texts: Iterable[str],
        prompt_format: PromptFormat | None = None,
        *,
        priority: int = BACKLOG,
        only_missing: bool = False,
        block: bool = False,
    ) -> int:
        """Enqueue chunk texts under ``prompt_format``'s layout; returns how many were enqueued.

        Every text is also indexed as a known chunk of the engine, so prompts that contain it
        verbatim are split there (:mod:`ragblend.matching`). ``only_missing`` skips texts
        already stored (checked now, on the caller's thread).
        """
        texts = [t for t in texts if t and t.strip()]
        known_chunks(self.engine).add(texts)
        if only_missing:
            texts = [t for t in texts if not self.is_cached(t, prompt_format)]
        return self._submit(self._head(prompt_format), texts, priority, block)

    def warm_ids(
        self,
        chunks: Iterable[Sequence[int]],
        prompt_format: PromptFormat | None = None,
        *,
        priority: int = BACKLOG,
        block: bool = False,
    ) -> int:
        """Enqueue tokenised chunks (exactly these ids are precomputed and keyed)."""
        head = self._head(prompt_format)
        items = [tuple(int(t) for t in c) for c in chunks if len(c)]
        return self._submit(head, items, priority, block)

    def _head(self, prompt_format: PromptFormat | None) -> tuple[int, ...]:
        head = self.engine.prompt_head(prompt_format)
        key = tuple(head)
        with self._lock:
            self._heads.setdefault(key, head)
        return key

    def is_cached(self, text: str, prompt_format: PromptFormat | None = None) -> bool:
        """Whether ``text``'s chunk KV is stored under ``prompt_format``'s layout."""
        return self.engine.is_cached(text, prompt_format=prompt_format)

    def _submit(
        self, head: tuple[int, ...], items: Iterable[Item], priority: int, block: bool
    ) -> int:
        if self._closed:
            raise RuntimeError("warmup pool is closed")
        added = 0
        for item in items:
            key = (head, item)
            with self._lock:
                if key in self._pending:
                    continue
                self._pending.add(key)
            if not self._room.acquire(blocking=block):
                with self._lock:
                    self._pending.discard(key)
                    self.dropped += 1
                continue
            self._queue.put((priority, next(self._seq), key))
            added += 1
        return added

    # ------------------------------------------------------------------ queries
    @contextlib.contextmanager
    def query(self) -> Iterator[None]:
        """Mark a query as running: until every query has ended, workers start no new item and
        the item in progress stops before its next layer (it is queued again, first in line)."""
        with self._lock:
            self._active_queries += 1
        try:
            yield
        finally:
            with self._lock:
                self._active_queries -= 1
                if not self._active_queries:
                    self._idle.notify_all()

    # ------------------------------------------------------------------ waiting
    def pending(self) -> int:
        """Items queued or being computed."""
        with self._lock:
            return len(self._pending)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted item is processed (or ``timeout`` s pass)."""
        if timeout is None:
            self._queue.join()
            return True
        deadline = time.monotonic() + timeout
        while self.pending():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    join = wait

    def close(self, wait: bool = True) -> None:
        """Stop the workers: finish queued work (``wait``) or abandon it cleanly."""
        if self._closed:
            return
        self._closed = True
        if not wait:
            while True:
                try:
                    _, _, key = self._queue.get_nowait()
                except queue.Empty:
                    break
                with self._lock:
                    self._pending.discard(key)
                self._room.release()
                self._queue.task_done()
        for _ in self._threads:
            self._queue.put((_STOP_PRIORITY, next(self._seq), _STOP))
        with self._lock:
            self._idle.notify_all()
        for t in self._threads:
            t.join()

    def __enter__(self) -> WarmupPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close(wait=exc[0] is None)

    # ------------------------------------------------------------------ worker
    def _between_layers(self) -> Callable[[], None] | None:
        return self._yield_to_queries if self.pause_during_queries else None

    def _yield_to_queries(self) -> None:
        if self._active_queries and not self._closed:
            raise _Preempted

    def _wait_for_idle(self) -> None:
        with self._lock:
            while self.pause_during_queries and self._active_queries and not self._closed:
                self._idle.wait(timeout=0.5)

    def _work(self) -> None:
        while True:
            priority, seq, key = self._queue.get()
            if key is _STOP:
                self._queue.task_done()
                return
            self._wait_for_idle()
            head, item = key
            try:
                stored = self._precompute_one(item, self._heads[head])
            except _Preempted:  # first again among its priority, once the query ends
                with self._lock:
                    self.preempted += 1
                self._queue.put((priority, seq, key))
                self._queue.task_done()
                continue
            with self._lock:
                self._pending.discard(key)
            self._room.release()
            self._notify_done(stored)
            self._queue.task_done()


class WarmupQueue(_Precomputing):
    """Precomputes chunks in the background so later queries hit the KV store.

    ``submit`` never blocks the caller for long: duplicates (queued or stored) are dropped and,
    when the queue is full, the oldest-pending work wins and new texts are counted as dropped
    (``block=True`` waits for room instead, for batch jobs). Items are chunk texts or, with
    ``submit_ids``, token ids. ``on_done(stored)`` is called after each item (False: skipped or
    failed), e.g. to drive a progress bar.
    """

    def __init__(
        self,
        engine: BlendEngine,
        prompt_format: PromptFormat | None = None,
        workers: int = 1,
        max_pending: int = 10_000,
        on_done: Callable[[bool], None] | None = None,
    ) -> None:
        self.engine = engine
        self.prompt_format = prompt_format or engine.prompt_format
        self._head = engine.prompt_head(self.prompt_format)
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._pending: set[str | tuple[int, ...]] = set()
        self.on_done = on_done
        self._lock = threading.Lock()
        self._closed = False
        self.stored = 0
        self.skipped = 0
        self.dropped = 0
        self.errors: list[str] = []
        self._threads = [
            threading.Thread(target=self._work, name=f"ragblend-warmup-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, texts: Iterable[str], block: bool = False) -> int:
        """Enqueue texts not yet stored or queued; returns how many were enqueued.

        Every text is also indexed as a known chunk of the engine, so prompts that contain it
        verbatim are split there (:mod:`ragblend.matching`).
        """
        texts = [t for t in texts if t and t.strip()]
        known_chunks(self.engine).add(texts)
        return self._submit(iter(texts), block)

    def submit_ids(self, chunks: Iterable[Sequence[int]], block: bool = False) -> int:
        """Enqueue tokenised chunks (exactly these ids are precomputed and keyed)."""
        return self._submit((tuple(int(t) for t in c) for c in chunks if len(c)), block)

    def _submit(self, items: Iterable[str | tuple[int, ...]], block: bool) -> int:
        if self._closed:
            raise RuntimeError("warmup queue is closed")
        added = 0
        for item in items:
            with self._lock:
                if item in self._pending:
                    continue
                self._pending.add(item)
            try:
                if block:
                    self._queue.put(item)
                else:
                    self._queue.put_nowait(item)
                added += 1
            except queue.Full:
                with self._lock:
                    self._pending.discard(item)
                    self.dropped += 1
        return added

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def join(self) -> None:
        """Block until every submitted text has been processed."""
        self._queue.join()

    def close(self, wait: bool = True) -> None:
        """Stop the workers: finish queued work (``wait``) or abandon it cleanly."""
        if self._closed:
            return
        self._closed = True
        if not wait:
            while True:
                try:
                    self._queue.get_nowait()
                    self._queue.task_done()
                except queue.Empty:
                    break
        for _ in self._threads:
            self._queue.put(_STOP)
        for t in self._threads:
            t.join()

    def __enter__(self) -> WarmupQueue:
        return self

    def __exit__(self, *exc) -> None:
        self.close(wait=exc[0] is None)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                self._queue.task_done()
                return
            stored = self._precompute_one(item, self._head)
            with self._lock:
                self._pending.discard(item)
            self._notify_done(stored)
            self._queue.task_done()
