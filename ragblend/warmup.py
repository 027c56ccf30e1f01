"""Background KV precompute: a deduplicating, bounded queue with worker threads."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Sequence

from ragblend.engine import BlendEngine
from ragblend.matching import known_chunks
from ragblend.prompt import PromptFormat, encode

log = logging.getLogger(__name__)
_STOP = object()


class WarmupQueue:
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
            stored = False
            try:
                if item is _STOP:
                    return
                ids = list(item) if isinstance(item, tuple) else encode(self.engine.tokenizer, item)
                stored = self.engine.precompute_ids(ids, self._head)
                if stored:
                    self.stored += 1
                else:
                    self.skipped += 1
            except Exception as exc:  # keep the worker alive; report, never crash the caller
                log.warning("warmup of a chunk failed: %s", exc)
                self.errors.append(str(exc))
            finally:
                if item is not _STOP:
                    with self._lock:
                        self._pending.discard(item)
                    if self.on_done is not None:
                        try:
                            self.on_done(stored)
                        except Exception as exc:  # a progress callback must not kill the worker
                            log.debug("warmup on_done callback failed: %s", exc)
                self._queue.task_done()
