"""ASGI middleware of the server: request ids and API keys (pure ASGI: streams pass through)."""

from __future__ import annotations

import contextvars
import hmac
import re
import uuid
from collections.abc import Sequence

from starlette.datastructures import MutableHeaders
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ragblend.serving.protocol import error_body

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ragblend_request_id", default=None
)
_SAFE_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def request_id() -> str | None:
    """The id of the request being handled (set by :class:`RequestIdMiddleware`)."""
    return REQUEST_ID.get()


class RequestIdMiddleware:
    """``X-Request-Id``: the client's (when it is a plain id of at most 128 characters) or a
    new one; echoed as a response header and readable with :func:`request_id`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _SAFE_ID.fullmatch(given) else uuid.uuid4().hex

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["X-Request-Id"] = rid
            await send(message)

        token = REQUEST_ID.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)


class ApiKeyMiddleware:
    """401 (OpenAI's error object) on ``/v1`` paths without ``Authorization: Bearer <key>``
    for one of ``api_keys``; ``/health``, ``/metrics``, ``/tokenize``, ``/detokenize`` stay
    open, as in vLLM. Each key is compared in constant time."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        if not api_keys:
            raise ValueError("ApiKeyMiddleware needs at least one key")
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    def allowed(self, given: bytes) -> bool:
        # every key is compared (no early exit): the time does not say which one matched
        matches = [hmac.compare_digest(given, key) for key in self.expected]
        return any(matches)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path") or ""
        protected = path == "/v1" or path.startswith("/v1/")
        if scope["type"] == "http" and protected:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not self.allowed(given):
                body = error_body(
                    "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)
