"""The ingress of ``ragblend serve --ray``: reads each HTTP request, finds its chunks, hands it
to a replica, and relays the replica's answer byte for byte.

Ray Serve's HTTP proxy does not show a request's body to a request router, so this thin
deployment (one replica, no CPU reserved) does: it reads the body, finds the known chunks in it
with the server's own matching (:func:`ragblend.serving.affinity.request_chunks` over the chunk
texts recorded with the shared store, read incrementally) and calls the replicas'
``asgi`` method through a ``DeploymentHandle`` with the chunk ids as the ``chunk_ids`` keyword,
which the chunk router reads. The replica runs the server app in-process and streams its ASGI
messages back; the ingress sends them on unchanged (status, headers, body, server-sent events).

``GET /health`` and ``GET /metrics`` are answered here from every replica at once
(``DeploymentHandle.broadcast``): /health is 200 when at least one replica serves and lists each
replica's own health under ``replicas``; /metrics is every replica's metrics with a ``replica``
label, plus ``ragblend:routed_requests_total{replica, reason}`` (the chunk router's decisions).

A replica that dies fails only the requests it was answering: a request whose answer had not
started is sent again once (to a live replica), one whose answer had started ends with a 503
(a stream ends with an ``error`` event, then ``data: [DONE]``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from ragblend.matching import ChunkIndex
from ragblend.serving import protocol as p
from ragblend.serving.affinity import ROUTED, chunk_id, request_chunks
from ragblend.serving.metrics import merge_labelled
from ragblend.serving.ray_replica import wire_scope
from ragblend.store.chunk_texts import ChunkTexts

log = logging.getLogger(__name__)

REPORT_TIMEOUT_S = 10.0
ATTEMPTS = 2  # a request whose replica died before answering is sent once more
Message = dict[str, Any]


class ChunkIngress:
    """The ingress deployment's body (``serve.ingress()`` wraps it; see the module docstring)."""

    def __init__(self, replicas: Any, redis_url: str, namespace: str | None = None) -> None:
        from ragblend.store.redis import RedisStore

        self.replicas = replicas  # a DeploymentHandle to the replica deployment
        self.calls = replicas.options(method_name="asgi", stream=True)
        self.store = RedisStore(redis_url, namespace=namespace)
        self.texts = ChunkTexts(self.store)
        self.index = ChunkIndex()
        self.scope: str | None = None

    def __serve_build_asgi_app__(self) -> Any:
        return _Asgi(self)

    # ------------------------------------------------------------------ ASGI
    async def serve_asgi(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        if method == "GET" and path == "/health":
            await _send_json(send, *await self.health())
            return
        if method == "GET" and path == "/metrics":
            await self.send_metrics(send)
            return
        body, gone = await _read_body(receive)
        if gone:
            return
        ids = await self.chunk_ids(path, body)
        relay = asyncio.ensure_future(self.relay(wire_scope(scope), body, ids, send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({relay, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, watch):
                task.cancel()  # the client left: cancelling the call closes the replica's side
            await asyncio.gather(relay, watch, return_exceptions=True)

    async def relay(self, scope: dict, body: bytes, ids: list[str], send: Any) -> None:
        """Send the request to a replica and its messages to the client."""
        started, sse = False, False
        for attempt in range(ATTEMPTS):
            answer = self.calls.remote(scope, body, chunk_ids=ids)
            try:
                async for message in answer:
                    if message.get("type") == "http.response.start":
                        started, sse = True, _is_sse(message)
                        message = _without_request_id(message)
                    await send(message)
                return
            except asyncio.CancelledError:
                answer.cancel()  # the client left: the replica's app sees a disconnect
                raise
            except Exception as exc:
                died = _replica_lost(exc)
                if not started and died and attempt + 1 < ATTEMPTS:
                    log.warning("a replica died before answering (%s); sending it again", exc)
                    continue
                log.warning("request failed on its replica: %s", exc)
                await _fail(send, started, sse, died, exc)
                return

    async def chunk_ids(self, path: str, body: bytes) -> list[str]:
        """Ids of the known chunks in a request (``[]`` when none, or not yet known)."""
        try:
            if self.scope is None:
                self.scope = await self.replicas.text_scope.remote()
            new = await asyncio.to_thread(self.texts.new_texts, self.scope)
            if new:
                self.index.add(new)
            texts = request_chunks(path, body, self.index)
        except Exception as exc:  # routing falls back to load; the replica still matches
            log.warning("cannot find the request's chunks: %s", exc)
            return []
        return [chunk_id(t) for t in texts]

    # ------------------------------------------------------------------ every replica
    async def reports(self) -> list[dict]:
        """Every replica's report (``ChunkReplica.report``); a replica that fails is left out."""
        try:
            got = await self.replicas.broadcast("report").results_async(
                timeout_s=REPORT_TIMEOUT_S, return_exceptions=True
            )
        except Exception as exc:  # no replica yet, or the deployment is gone
            log.info("no replica report: %s", exc)
            return []
        return [r for r in got if isinstance(r, dict)]

    async def health(self) -> tuple[int, dict]:
        """``GET /health``: 200 when a replica serves; each replica's health under
        ``replicas``; ``running``, ``waiting`` and ``rewarming`` summed over the replicas."""
        reports = await self.reports()
        replicas = {r["replica"]: r["health"] for r in reports}
        ok = [r["health"] for r in reports if r["status"] == 200]
        if not ok:
            error = "no replica serves yet; retry later" if not reports else "no replica serves"
            status = "loading" if not reports else "unavailable"
            return 503, {"status": status, "error": error, "replicas": replicas}
        body: dict[str, Any] = {"status": "ok"}
        for key in ("running", "waiting", "rewarming"):
            body[key] = sum(int(h.get(key, 0)) for h in ok)
        return 200, {**body, "replicas": replicas}

    async def send_metrics(self, send: Any) -> None:
        texts = {r["replica"]: r["metrics"] for r in await self.reports()}
        routed = [
            "# HELP ragblend:routed_requests_total Requests the chunk router sent, by replica "
            "and reason (affinity, load, new_chunks, no_chunk)",
            "# TYPE ragblend:routed_requests_total counter",
        ]
        for (replica, reason), n in sorted(ROUTED.snapshot().items()):
            routed.append(
                f'ragblend:routed_requests_total{{reason="{reason}",replica="{replica}"}} {n}'
            )
        out = merge_labelled(texts) + ("\n".join(routed) + "\n").encode()
        headers = [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": out})


class _Asgi:
    """The ingress as an ASGI 3 app (an object whose ``__call__`` is a coroutine function, as
    uvicorn's lifespan runner, which Serve uses, expects)."""

    def __init__(self, ingress: ChunkIngress) -> None:
        self.ingress = ingress

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        await self.ingress.serve_asgi(scope, receive, send)


def _replica_lost(exc: BaseException) -> bool:
    """Whether ``exc`` says the replica (its actor) died or cannot be reached."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    return isinstance(exc, (RayActorError, ActorUnavailableError))


def _without_request_id(start: Message) -> Message:
    """The replica's response start without its ``x-request-id`` header: Serve's proxy adds
    the request's id to every response (the id the app saw, so it is not lost)."""
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"x-request-id"]
    return {**start, "headers": headers}


def _is_sse(start: Message) -> bool:
    headers = dict(start.get("headers") or [])
    return headers.get(b"content-type", b"").startswith(b"text/event-stream")


async def _fail(send: Any, started: bool, sse: bool, died: bool, exc: BaseException) -> None:
    """Tell the client its request failed: an OpenAI error (503 when the replica died), or,
    after the answer started, an error event and ``[DONE]`` (streams) or the body's end."""
    status = 503 if died else 500
    why = "the replica serving this request died" if died else f"the replica failed: {exc}"
    kind = "server_error"
    error = p.error_body(f"{why}; retry", kind, code="service_unavailable" if died else None)
    if not started:
        await _send_json(send, status, error)
        return
    tail = b""
    if sse:
        tail = b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"
    await send({"type": "http.response.body", "body": tail, "more_body": False})


async def _send_json(send: Any, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _read_body(receive: Any) -> tuple[bytes, bool]:
    """The request's whole body, and whether the client disconnected while sending it."""
    parts = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", True
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(parts), False


async def _disconnected(receive: Any) -> None:
    """Returns when the client disconnects."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
