"""The OpenAI-compatible ASGI app (FastAPI) over one engine and its :class:`Scheduler`.

Thin: requests are tokenised on worker threads (:class:`JobBuilder`), generated on the
scheduler's compute thread, and answered as OpenAI JSON or server-sent events ending with
``data: [DONE]``. Every error is OpenAI's ``{"error": {...}}`` object with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ragblend.engine import BlendEngine
from ragblend.errors import RagblendError
from ragblend.serving import protocol as p
from ragblend.serving.events import Delta, Failed, Finished, GenerationJob, QueueFull
from ragblend.serving.jobs import JobBuilder, RequestError
from ragblend.serving.metrics import ServerMetrics
from ragblend.serving.scheduler import Scheduler

log = logging.getLogger(__name__)
_ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}


def create_app(
    engine: BlendEngine,
    *,
    model_names: tuple[str, ...] | None = None,
    api_key: str | None = None,
    max_running: int = 8,
    max_queue: int = 64,
    default_max_tokens: int = 256,
    scheduler_thread: bool = True,
) -> FastAPI:
    """The server's app; the scheduler thread starts and stops with the app's lifespan.

    ``model_names``: the names requests may use (default: the engine's name); ``api_key``:
    every endpoint but ``/health`` then needs ``Authorization: Bearer <api_key>``;
    ``scheduler_thread=False``: the caller runs ``app.state.scheduler.run()`` on a thread of its
    choice (the app's shutdown stops it).
    """
    names = model_names or (engine.name,)
    metrics = ServerMetrics()
    scheduler = Scheduler(engine, max_running, max_queue, metrics)
    engine.on_miss = scheduler.rewarm  # a chunk found but missed is precomputed again
    jobs = JobBuilder(engine, tuple(names), default_max_tokens)
    started = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if scheduler_thread:
            scheduler.start()
        try:
            yield
        finally:
            await run_in_threadpool(scheduler.stop)

    app = FastAPI(title="ragblend", lifespan=lifespan)
    app.state.scheduler, app.state.metrics, app.state.engine = scheduler, metrics, engine
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    def error(status: int, message: str, type_: str | None = None, **fields: Any) -> JSONResponse:
        metrics.error(status)
        kind = type_ or _ERROR_TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
        return JSONResponse(p.error_body(message, kind, **fields), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid" or not loc:  # not JSON, or not an object
            msg = f"the body must be a JSON object: {first.get('msg', '')}"
            return error(400, msg, code="invalid_json")
        what = ".".join(loc) or "body"
        return error(400, f"{what}: {first.get('msg', 'invalid value')}", param=what or None)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException) -> JSONResponse:
        return error(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestError)
    async def refused(_request: Request, exc: RequestError) -> JSONResponse:
        return error(exc.status, exc.message, exc.type, code=exc.code, param=exc.param)

    @app.exception_handler(RagblendError)
    async def bad_input(_request: Request, exc: RagblendError) -> JSONResponse:
        return error(400, str(exc))

    @app.exception_handler(QueueFull)
    async def busy(_request: Request, exc: QueueFull) -> JSONResponse:
        return error(429, f"the server is busy: {exc}; retry later", code="rate_limit_exceeded")

    @app.get("/health")
    async def health() -> dict:
        return {
            "status": "ok",
            "running": scheduler.running,
            "waiting": scheduler.waiting,
            "rewarming": scheduler.rewarming,
        }

    @app.get("/v1/models")
    async def models() -> dict:
        return p.models_list(list(names), started)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/ragblend/chunks")
    async def chunks(body: p.ChunksRequest) -> dict:
        """Precompute ``texts`` (one chunk per compute step, between decode steps)."""
        if any(not t.strip() for t in body.texts):
            raise RequestError("texts must not be empty", param="texts")
        calls = [scheduler.call(functools.partial(engine.precompute, [t])) for t in body.texts]
        stored = sum(await asyncio.gather(*(asyncio.wrap_future(c) for c in calls)))
        await run_in_threadpool(lambda: engine.known_chunks().add(body.texts))
        return {
            "object": "ragblend.chunks",
            "stored": stored,
            "already_stored": len(body.texts) - stored,
        }

    @app.post("/v1/chat/completions")
    async def chat(body: p.ChatCompletionRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        job = await run_in_threadpool(jobs.chat, body)
        return await answer(request, body, job, arrived, chat=True)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        arrived = time.perf_counter()
        job = await run_in_threadpool(jobs.completion, body)
        return await answer(request, body, job, arrived, chat=False)

    async def answer(request: Request, body: Any, job: GenerationJob, arrived: float, chat: bool):
        job.arrived = arrived
        handle = scheduler.submit(job, asyncio.get_running_loop())
        rid = p.completion_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            events = _sse(handle, rid, body, chat, metrics)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            while True:
                event = await _next_or_disconnect(handle, request)
                if event is None:
                    return Response(status_code=499)
                if isinstance(event, Failed):
                    return error(event.status, event.message)
                if isinstance(event, Finished):
                    build = p.chat_response if chat else p.text_response
                    out = build(rid, body.model, event.text, event.finish_reason, event.stats)
                    # also as a header: clients that keep only headers (LangChain's
                    # ChatOpenAI(include_response_headers=True)) see what happened too
                    header = {"x-ragblend": json.dumps(out["ragblend"], separators=(",", ":"))}
                    return JSONResponse(out, headers=header)
        finally:
            handle.cancel()

    return app


async def _next_or_disconnect(handle, request: Request, poll_s: float = 0.5):
    """The next event, or None when the client has gone away (checked every ``poll_s``)."""
    while True:
        try:
            return await asyncio.wait_for(handle.next_event(), poll_s)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None


async def _sse(
    handle, rid: str, body: Any, chat: bool, metrics: ServerMetrics
) -> AsyncIterator[str]:
    """Server-sent events of one request; the last data event carries ``ragblend``."""

    def event(data: dict) -> str:
        return f"data: {json.dumps(data)}\n\n"

    def chunk(text: str, finish: str | None = None, **extra: Any) -> dict:
        if chat:
            delta = {"content": text} if text or finish is None else {}
            return p.chat_chunk(rid, body.model, delta, finish, **extra)
        return p.text_chunk(rid, body.model, text, finish, **extra)

    try:
        if chat:
            yield event(p.chat_chunk(rid, body.model, {"role": "assistant", "content": ""}))
        while True:
            ev = await handle.next_event()
            if isinstance(ev, Delta):
                yield event(chunk(ev.text))
            elif isinstance(ev, Failed):
                metrics.error(ev.status)
                kind = "invalid_request_error" if ev.status < 500 else "server_error"
                yield event(p.error_body(ev.message, kind))
                break
            elif isinstance(ev, Finished):
                info = p.RagblendInfo.of(ev.stats).model_dump()
                if body.include_usage:
                    yield event(chunk("", ev.finish_reason))
                    usage = p.Usage.of(ev.stats).model_dump()
                    last = {**chunk("", ev.finish_reason), "choices": [], "usage": usage}
                    yield event({**last, "ragblend": info})
                else:
                    yield event(chunk("", ev.finish_reason, ragblend=info))
                break
        yield "data: [DONE]\n\n"
    finally:  # also when the client disconnects (the response task is cancelled)
        handle.cancel()


class ApiKeyMiddleware:
    """401 (OpenAI's error object) without ``Authorization: Bearer <key>``; /health is open."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") != "/health":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = p.error_body(
                    "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
