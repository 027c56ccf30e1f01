"""The app's engine side: loading the engine, then its scheduler and job builder; health."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ragblend.engine import BlendEngine
from ragblend.serving.events import Unavailable
from ragblend.serving.jobs import JobBuilder
from ragblend.serving.metrics import ServerMetrics
from ragblend.serving.scheduler import Scheduler

log = logging.getLogger(__name__)
EngineSource = BlendEngine | Callable[[], BlendEngine]


class ServerState:
    """An engine (given, or loaded by ``source()`` on the compute thread), its
    :class:`Scheduler` and :class:`JobBuilder`; :meth:`ready` raises :class:`Unavailable`
    (HTTP 503) until they exist and while the scheduler loop does not run."""

    def __init__(
        self,
        source: EngineSource,
        metrics: ServerMetrics,
        *,
        model_names: tuple[str, ...] = (),
        max_running: int = 8,
        max_queue: int = 64,
        default_max_tokens: int = 256,
        on_ready: Callable[[ServerState], Any] | None = None,
    ) -> None:
        self.metrics = metrics
        self.model_names = model_names
        self.limits = (max_running, max_queue, default_max_tokens)
        self.on_ready = on_ready
        self.engine: BlendEngine | None = None
        self.scheduler: Scheduler | None = None
        self.jobs: JobBuilder | None = None
        self.load_error: BaseException | None = None
        self._loader = None if isinstance(source, BlendEngine) else source
        self._thread: threading.Thread | None = None
        self._stopped = False
        if isinstance(source, BlendEngine):
            self._attach(source)

    @property
    def names(self) -> tuple[str, ...]:
        """The model names requests may use (``model_names``, then the engine's name)."""
        own = (self.engine.name,) if self.engine is not None else ()
        return tuple(dict.fromkeys((*self.model_names, *own)))

    def _attach(self, engine: BlendEngine) -> None:
        max_running, max_queue, default_max_tokens = self.limits
        scheduler = Scheduler(engine, max_running, max_queue, self.metrics)
        engine.on_miss = scheduler.rewarm  # a chunk found but missed is precomputed again
        self.engine, self.scheduler = engine, scheduler
        self.jobs = JobBuilder(engine, self.names, default_max_tokens)
        if self.on_ready is not None:
            self.on_ready(self)

    def load(self) -> None:
        """Load the engine if it is not there yet (on the calling thread)."""
        if self.engine is not None or self._loader is None:
            return
        try:
            engine = self._loader()
        except Exception as exc:
            self.load_error = exc
            raise
        self._attach(engine)

    def run(self) -> None:
        """Load the engine, then run the scheduler loop on the calling thread until
        :meth:`stop` (``ragblend serve`` calls this on its main thread)."""
        self.load()
        if not self._stopped and self.scheduler is not None:
            self.scheduler.run()

    def start(self) -> None:
        """:meth:`run` on a thread of its own."""
        if self.scheduler is not None:  # already loaded: ready before the thread runs
            self.scheduler.open()
        self._thread = threading.Thread(target=self._run_logged, name="ragblend-compute")
        self._thread.daemon = True
        self._thread.start()

    def _run_logged(self) -> None:
        try:
            self.run()
        except Exception:
            log.exception("the server's compute thread stopped")

    def stop(self) -> None:
        self._stopped = True
        if self.scheduler is not None:
            self.scheduler.stop()
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join()

    def ready(self) -> tuple[BlendEngine, Scheduler, JobBuilder]:
        """The engine, scheduler and job builder; raises Unavailable when not serving."""
        problem = self.problem()
        if problem is not None:
            raise Unavailable(problem)
        assert self.engine is not None and self.scheduler is not None and self.jobs is not None
        return self.engine, self.scheduler, self.jobs

    def problem(self) -> str | None:
        """Why requests cannot be served now (None: they can)."""
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self.scheduler is None:
            return "the model is loading; retry later"
        if self.scheduler.failure is not None:
            return f"the server's compute loop stopped: {self.scheduler.failure}"
        if not self.scheduler.alive:
            return "the server is not running (starting or shutting down); retry later"
        return None

    def health(self) -> tuple[int, dict]:
        """``GET /health``'s status and body."""
        problem = self.problem()
        if problem is not None or self.scheduler is None:
            status = "loading" if self.scheduler is None and not self.load_error else "unavailable"
            return 503, {"status": status, "error": problem}
        s = self.scheduler
        body = {"status": "ok", "running": s.running, "waiting": s.waiting}
        return 200, {**body, "rewarming": s.rewarming}
