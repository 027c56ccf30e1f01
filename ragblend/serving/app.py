"""The OpenAI-compatible ASGI app (FastAPI) over one engine and its :class:`Scheduler`.

Thin: requests are tokenised on worker threads (:class:`JobBuilder`), generated on the
scheduler's compute thread, and answered as OpenAI JSON or server-sent events ending with
``data: [DONE]`` (:mod:`ragblend.serving.streaming`). Every error is OpenAI's
``{"error": {...}}`` object with a 4xx/5xx status; 503 while the model loads, after the
compute thread stopped and during shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from ragblend.errors import RagblendError
from ragblend.serving import protocol as p
from ragblend.serving.events import Failed, Finished, QueueFull, Unavailable
from ragblend.serving.jobs import RequestError
from ragblend.serving.logprobs import chat_logprobs, completion_logprobs
from ragblend.serving.metrics import ServerMetrics
from ragblend.serving.middleware import ApiKeyMiddleware, RequestIdMiddleware, request_id
from ragblend.serving.state import EngineSource, ServerState
from ragblend.serving.streaming import (
    TimedOut,
    Waiter,
    sse,
    timeout_message,
    usage_events,
)

log = logging.getLogger(__name__)
_ERROR_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error"}


def create_app(
    engine: EngineSource,
    *,
    model_names: tuple[str, ...] | None = None,
    api_key: str | Sequence[str] | None = None,
    max_running: int = 8,
    max_queue: int = 64,
    default_max_tokens: int = 256,
    scheduler_thread: bool = True,
    timeout_s: float | None = None,
    keepalive_s: float = 5.0,
    allowed_origins: Sequence[str] = (),
) -> FastAPI:
    """The server's app; the compute thread starts and stops with the app's lifespan.

    ``engine``: a :class:`BlendEngine`, or a function that loads one (called on the compute
    thread; ``/health`` answers 503 until it returns). ``model_names``: names requests may use
    besides the engine's own. ``api_key``: one key or several; every ``/v1`` path then needs
    ``Authorization: Bearer <key>``. ``timeout_s``: a request still unanswered after that many
    seconds is cancelled and gets an error. ``keepalive_s``: a stream sends a comment line
    when no event came for that long. ``allowed_origins``: CORS origins (none by default).
    ``scheduler_thread=False``: the caller runs ``app.state.server.run()`` on a thread of its
    choice (it loads the engine if needed; the app's shutdown stops it).
    """
    metrics = ServerMetrics()
    started = int(time.time())

    def published(state: ServerState) -> None:
        app.state.scheduler, app.state.engine = state.scheduler, state.engine

    server = ServerState(
        engine,
        metrics,
        model_names=tuple(model_names or ()),
        max_running=max_running,
        max_queue=max_queue,
        default_max_tokens=default_max_tokens,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if scheduler_thread:
            server.start()
        try:
            yield
        finally:
            await run_in_threadpool(server.stop)

    app = FastAPI(title="ragblend", lifespan=lifespan)
    app.state.server, app.state.metrics = server, metrics
    app.state.scheduler, app.state.engine = server.scheduler, server.engine
    server.on_ready = published
    keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=keys)
    app.add_middleware(RequestIdMiddleware)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "x-ragblend"],
        )

    def error(status: int, message: str, type_: str | None = None, **fields: Any) -> JSONResponse:
        metrics.error(status)
        kind = type_ or _ERROR_TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
        log.info("request %s: %d %s", request_id(), status, message)
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

    @app.exception_handler(Unavailable)
    async def unavailable(_request: Request, exc: Unavailable) -> JSONResponse:
        return error(503, str(exc), code="service_unavailable")

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = server.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models")
    async def models() -> dict:
        server.ready()
        return p.models_list(list(server.names), started)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest) -> dict:
        engine, _, jobs = server.ready()
        ids = await run_in_threadpool(jobs.tokenize, body)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.context_window}

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> dict:
        _, _, jobs = server.ready()
        return {"prompt": await run_in_threadpool(jobs.detokenize, body)}

    @app.post("/v1/ragblend/chunks")
    async def chunks(body: p.ChunksRequest) -> dict:
        """Precompute ``texts`` (one chunk per compute step, between decode steps)."""
        engine, scheduler, _ = server.ready()
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
        return await answer(request, body, chat=True)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        return await answer(request, body, chat=False)

    async def answer(request: Request, body: Any, chat: bool) -> Response:
        arrived = time.perf_counter()
        rid = request_id()
        if unknown := body.unknown_fields():
            log.warning("request %s: ignoring unknown fields: %s", rid, ", ".join(unknown))
        if bad := body.unsupported():
            raise RequestError(
                f"not supported by this server: {', '.join(bad)}",
                code="unsupported_field",
                param=bad[0],
            )
        engine, scheduler, jobs = server.ready()
        job = await run_in_threadpool(jobs.chat if chat else jobs.completion, body)
        job.arrived, job.request_id = arrived, rid or ""
        handle = scheduler.submit(job, asyncio.get_running_loop())
        deadline = arrived + timeout_s if timeout_s else None
        waiter = Waiter(handle, deadline)
        cid = p.completion_id("chatcmpl" if chat else "cmpl")
        offset = [0]  # where the next token starts in a completion's text (legacy logprobs)

        def logprobs(items: list) -> dict | None:
            if job.logprobs is None:
                return None
            if chat:
                return chat_logprobs(engine.tokenizer, items)
            shaped, offset[0] = completion_logprobs(engine.tokenizer, items, offset[0])
            return shaped

        def chunk(text: str, finish: str | None = None, **extra: Any) -> dict:
            if chat:
                delta = {"content": text} if text or finish is None else {}
                return p.chat_chunk(cid, body.model, delta, finish, **extra)
            return p.text_chunk(cid, body.model, text, finish, **extra)

        def final(done: Finished) -> list[dict]:
            logged(done, rid)
            info = p.RagblendInfo.of(done.stats, rid).model_dump()
            return usage_events(chunk, done, info, body.include_usage)

        if body.stream:
            role = {"role": "assistant", "content": ""}
            first = p.chat_chunk(cid, body.model, role) if chat else None
            events = sse(waiter, chunk, final, logprobs, metrics, keepalive_s, timeout_s, first)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            event = await waiter.event_or_gone(request)
            while event is not None and not isinstance(event, (Failed, Finished, TimedOut)):
                event = await waiter.event_or_gone(request)
            if event is None:
                return Response(status_code=499)
            if isinstance(event, TimedOut):
                return error(408, timeout_message(timeout_s), code="request_timeout")
            if isinstance(event, Failed):
                return error(event.status, event.message)
            logged(event, rid)
            build = p.chat_response if chat else p.text_response
            lp = logprobs(event.logprobs) if event.logprobs is not None else None
            out = build(cid, body.model, event.text, event.finish_reason, event.stats, rid, lp)
            # also as a header: clients that keep only headers (LangChain's
            # ChatOpenAI(include_response_headers=True)) see what happened too
            header = {"x-ragblend": json.dumps(out["ragblend"], separators=(",", ":"))}
            return JSONResponse(out, headers=header)
        finally:
            handle.cancel()

    def logged(done: Finished, rid: str | None) -> None:
        s = done.stats
        log.info(
            "request %s: mode=%s prompt=%d cached=%d completion=%d ttft=%.1fms finish=%s",
            rid, s.mode, s.prompt_tokens, s.cached_tokens, s.completion_tokens,
            s.ttft_ms, done.finish_reason,
        )  # fmt: skip

    return app
