"""WarmupPool scheduling: retrieval misses jump the backlog; workers pause while a query runs,
an item in progress yields before its next layer, and compute runs on threads that end with it.

The engine here is a recording stand-in (the pool only needs ``prompt_head``, ``is_cached``,
``precompute_ids`` and a tokenizer); precompute itself is covered in test_warmup.py.
"""

import threading
import time

from ragblend.warmup import RETRIEVAL, WarmupPool


class RecordingEngine:
    prompt_format = None

    def __init__(self) -> None:
        self.order: list[list[int]] = []
        self.gate = threading.Event()
        self.started = threading.Event()

    def prompt_head(self, prompt_format=None) -> list[int]:
        return [1]

    def is_cached(self, text, prompt_format=None) -> bool:
        return False

    def precompute_ids(self, ids, head, between_layers=None) -> bool:
        self.started.set()
        self.gate.wait(5)
        self.order.append(list(ids))
        return True


def test_retrieval_misses_run_before_the_ingestion_backlog():
    engine = RecordingEngine()
    with WarmupPool(engine) as pool:
        pool.warm_ids([[10]])  # occupies the worker until the gate opens
        assert engine.started.wait(5)
        pool.warm_ids([[20], [21]])
        pool.warm_ids([[30]], priority=RETRIEVAL)
        engine.gate.set()
        assert pool.wait(5)
    assert engine.order == [[10], [30], [20], [21]]


def test_workers_start_no_new_chunk_while_a_query_runs():
    engine = RecordingEngine()
    engine.gate.set()
    with WarmupPool(engine) as pool:
        with pool.query():
            pool.warm_ids([[1], [2]])
            assert not pool.wait(0.3)  # paused: nothing done
            assert engine.order == []
        assert pool.wait(5)
    assert engine.order == [[1], [2]]


class LayeredEngine(RecordingEngine):
    """Precomputes in four "layers", calling the pool's hook before each (as ChunkCache does);
    the first layer of the first attempt waits for ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers: list[tuple[int, int]] = []
        self.threads: list[threading.Thread] = []

    def precompute_ids(self, ids, head, between_layers=None) -> bool:
        self.threads.append(threading.current_thread())
        for layer in range(4):
            if between_layers is not None:
                between_layers()
            self.layers.append((ids[0], layer))
            if not self.started.is_set():
                self.started.set()
                self.gate.wait(5)
        self.order.append(list(ids))
        return True


def test_a_query_stops_the_item_in_progress_before_its_next_layer_and_it_is_redone_after():
    engine = LayeredEngine()
    with WarmupPool(engine) as pool:
        pool.warm_ids([[7]])
        assert engine.started.wait(5)  # inside layer 0
        with pool.query():
            engine.gate.set()
            deadline = time.monotonic() + 5
            while not pool.preempted and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pool.preempted == 1
            assert engine.layers == [(7, 0)]  # layer 1 never started while the query ran
            assert engine.order == [] and pool.pending() == 1
        assert pool.wait(5)
    assert engine.order == [[7]]
    assert engine.layers == [(7, 0), (7, 0), (7, 1), (7, 2), (7, 3)]
    assert pool.stored == 1 and pool.errors == []


def test_each_item_is_computed_on_a_thread_that_ends_with_it():
    engine = LayeredEngine()
    engine.gate.set()
    with WarmupPool(engine) as pool:
        pool.warm_ids([[1], [2]])
        assert pool.wait(5)
        workers = set(pool._threads)
    assert len(engine.threads) == 2 and len(set(engine.threads)) == 2
    for thread in engine.threads:
        assert thread not in workers and thread.name == "ragblend-warmup-compute"
        assert not thread.is_alive()


def test_duplicates_under_one_layout_are_queued_once():
    engine = RecordingEngine()
    engine.gate.set()
    with WarmupPool(engine) as pool:
        with pool.query():
            assert pool.warm_ids([[5], [5]]) == 1
        assert pool.wait(5)
    assert engine.order == [[5]]


def _counters_checked_under_lock(cls):
    """A subclass whose counters fail (in the worker, so as an error) when set without the lock."""

    class Checked(cls):
        def __setattr__(self, name, value):
            if name in ("stored", "skipped", "dropped") and name in self.__dict__:  # not __init__
                assert self._lock.locked(), f"{name} updated outside the lock"
            super().__setattr__(name, value)

    return Checked


def test_warmup_counters_are_updated_under_the_lock():
    from ragblend.warmup import WarmupQueue

    for cls in (WarmupPool, WarmupQueue):
        engine = RecordingEngine()
        engine.gate.set()
        queue = _counters_checked_under_lock(cls)(engine, workers=2)
        if cls is WarmupQueue:
            queue.submit_ids([[i] for i in range(8)])
            queue.join()
        else:
            queue.warm_ids([[i] for i in range(8)])
            assert queue.wait(5)
        queue.close()
        assert queue.errors == [] and queue.stored == 8, cls.__name__
