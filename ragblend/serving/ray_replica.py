"""One replica of ``ragblend serve --ray``: today's server app and engine, driven by the ingress.

Each replica is a Ray Serve replica (an actor) holding its own engine and its own RAM tier, a
:class:`~ragblend.store.layered.LayeredStore` of a ``MemoryStore`` in front of the shared Redis
tier (a single server or a Redis Cluster), so a chunk precomputed anywhere on that store is a
hit here. It runs the very ASGI app of ``ragblend serve`` (:func:`ragblend.serving.app.
create_app`) in-process: :meth:`ChunkReplica.asgi` plays one HTTP request the ingress read
into the app and streams the app's ASGI messages back, so every route answers as the single
process does, server-sent events included (each answer names its replica in an
``x-ragblend-replica`` header). A request whose caller goes away (the client
disconnected and the ingress cancelled the call) reads as a client disconnect to the app.

No Ray import here: Ray Serve wraps the class (``ragblend.serving.ray_serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ragblend.errors import RagblendError

log = logging.getLogger(__name__)

#: the scope keys a replica needs to play a request (plain data: they cross processes)
SCOPE_KEYS = (
    "type", "http_version", "method", "scheme", "path", "raw_path", "query_string",
    "root_path", "headers", "client", "server",
)  # fmt: skip
LOAD_POLL_S = 0.05
REPLICA_HEADER = b"x-ragblend-replica"  # names the replica that answered, on every answer


@dataclass(frozen=True)
class ReplicaSettings:
    """What every replica is built from (sent to each replica's process)."""

    model: str
    redis_url: str
    config: dict = field(default_factory=dict)  # BlendConfig's keyword arguments
    namespace: str | None = None
    ram_bytes: int | None = None  # the RAM tier's capacity (None: MemoryStore's default)
    threads: int = 1  # torch threads of the replica's compute thread
    model_names: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    max_running: int = 8
    max_queue: int = 64
    max_tokens: int = 256
    timeout_s: float | None = None
    allowed_origins: tuple[str, ...] = ()


def wire_scope(scope: dict) -> dict:
    """The parts of an ASGI HTTP scope a replica needs, as plain data."""
    out = {k: scope[k] for k in SCOPE_KEYS if k in scope}
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
    for key in ("client", "server"):
        if out.get(key) is not None:
            out[key] = tuple(out[key])
    return out


class ChunkReplica:
    """A replica's body: loads the engine at construction (Serve routes nothing to it before),
    then serves requests the ingress hands over."""

    def __init__(self, settings: ReplicaSettings) -> None:
        import torch

        from ragblend.config import BlendConfig
        from ragblend.engine import BlendEngine
        from ragblend.serving.app import create_app
        from ragblend.store.cli import StoreFlags, open_store

        torch.set_num_threads(max(1, settings.threads))
        self.settings = settings
        flags = StoreFlags(redis_url=settings.redis_url, namespace=settings.namespace)
        self.store = open_store(flags, ram_front=True, ram_bytes=settings.ram_bytes)
        config = BlendConfig(**settings.config)

        def load() -> BlendEngine:
            return BlendEngine.from_pretrained(settings.model, config=config, store=self.store)

        self.app = create_app(
            load,
            model_names=settings.model_names,
            api_key=list(settings.api_keys),
            max_running=settings.max_running,
            max_queue=settings.max_queue,
            default_max_tokens=settings.max_tokens,
            scheduler_thread=False,
            timeout_s=settings.timeout_s,
            allowed_origins=settings.allowed_origins,
        )
        self.server = self.app.state.server
        self.server.start()  # loads the engine, then runs the scheduler, on one compute thread
        while self.server.problem() is not None and self.server.load_error is None:
            time.sleep(LOAD_POLL_S)
        if self.server.load_error is not None:
            raise RagblendError(f"the replica could not load {settings.model}: "
                                f"{self.server.load_error}")  # fmt: skip
        # ready once the compute loop has prepared decoding (native kernels loaded or built)
        self.server.scheduler.call(lambda: None).result()
        self.replica_id = _replica_id()
        log.info("replica %s serves %s", self.replica_id, settings.model)

    async def asgi(
        self, scope: dict, body: bytes, chunk_ids: Sequence[str] = ()
    ) -> AsyncIterator[dict]:
        """Play one HTTP request (``scope`` from :func:`wire_scope`, the whole ``body``) into
        the app; yields its ASGI messages. ``chunk_ids`` are for the router only. Closing the
        generator early (the caller is gone) tells the app the client disconnected."""
        del chunk_ids
        messages: asyncio.Queue[dict | None] = asyncio.Queue()
        gone = asyncio.Event()
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            await messages.put(dict(message))

        # spec 2.3: Starlette's streaming responses watch receive() for the disconnect
        full = {**scope, "asgi": {"version": "3.0", "spec_version": "2.3"}, "state": {}}
        task = asyncio.create_task(self.app(full, receive, send))
        task.add_done_callback(lambda _t: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                if message.get("type") == "http.response.start":
                    headers = [
                        *message.get("headers", []),
                        (REPLICA_HEADER, self.replica_id.encode()),
                    ]
                    message = {**message, "headers": headers}
                yield message
                if message.get("type") == "http.response.body" and not message.get("more_body"):
                    break
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        finally:
            gone.set()  # the app sees a disconnect and frees the request's slot

    def report(self) -> dict[str, Any]:
        """This replica's id, ``/health`` status and body, and ``/metrics`` text."""
        status, body = self.server.health()
        return {
            "replica": self.replica_id,
            "status": status,
            "health": body,
            "metrics": self.server.metrics.render().decode("utf-8"),
        }

    def text_scope(self) -> str:
        """What this engine's chunk texts are grouped by in the store (the ingress reads the
        texts of this scope to find chunks in requests)."""
        engine, _, _ = self.server.ready()
        return engine.chunks.text_scope

    def check_health(self) -> None:
        """Ray Serve's health check: raises when the compute loop stopped (Serve then replaces
        this replica)."""
        scheduler = self.server.scheduler
        if self.server.load_error is not None or (scheduler and scheduler.failure is not None):
            raise RagblendError(self.server.problem() or "the replica failed")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.server.stop()
            self.store.close()


def _replica_id() -> str:
    """The Serve replica id of this process ("local" outside Serve)."""
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:
        return "local"
