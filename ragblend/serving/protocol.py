"""OpenAI-compatible request and response bodies (pydantic), plus ragblend's additions.

The shapes follow OpenAI's Chat Completions and (legacy) Completions APIs, as vLLM's
``entrypoints/openai/protocol.py`` does: unknown request fields are accepted and ignored, and
vLLM's ``ignore_eos`` is honoured. ragblend adds ``"ragblend": {"mode": ...}`` to a request
and a ``ragblend`` object (:class:`RagblendInfo`) to every response.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ragblend.generation import BlendStats

ModeName = Literal["full", "prefix", "reuse", "blend"]


class RagblendOptions(BaseModel):
    """``"ragblend": {"mode": "full"}`` in a request body (OpenAI clients' ``extra_body``)."""

    model_config = ConfigDict(extra="forbid")
    mode: ModeName | None = None


class _Request(BaseModel):
    """The sampling fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    ragblend: RagblendOptions | None = None

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's text (text parts joined; other parts are not supported)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text or "" for part in self.content if part.type == "text")


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[str]

    def token_budget(self) -> int | None:
        return self.max_tokens


class ChunksRequest(BaseModel):
    """``POST /v1/ragblend/chunks``: chunk texts to precompute."""

    model_config = ConfigDict(extra="forbid")
    texts: list[str] = Field(min_length=1)


class RagblendInfo(BaseModel):
    """What happened to a request: the mode that ran, its TTFT, hits and misses, and why a
    blend/reuse request ran a full prefill (``fallback_reason``; None when it did not)."""

    mode: str
    ttft_ms: float
    chunk_hits: int
    chunk_misses: int
    fallback_reason: str | None = None

    @classmethod
    def of(cls, stats: BlendStats) -> RagblendInfo:
        return cls(
            mode=stats.mode,
            ttft_ms=round(stats.ttft_ms, 3),
            chunk_hits=stats.chunk_hits,
            chunk_misses=stats.chunk_misses,
            fallback_reason=stats.fallback_reason,
        )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, stats: BlendStats) -> Usage:
        prompt, completion = stats.prompt_tokens, stats.completion_tokens
        return cls(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def chat_response(rid: str, model: str, text: str, finish: str, stats: BlendStats) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": now(),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": None,
            }
        ],
        "usage": Usage.of(stats).model_dump(),
        "ragblend": RagblendInfo.of(stats).model_dump(),
    }


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None = None, **extra: Any) -> dict:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    body = {"id": rid, "object": "chat.completion.chunk", "created": now(), "model": model}
    return {**body, "choices": [choice], **extra}


def text_response(rid: str, model: str, text: str, finish: str, stats: BlendStats) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": now(),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
        "usage": Usage.of(stats).model_dump(),
        "ragblend": RagblendInfo.of(stats).model_dump(),
    }


def text_chunk(rid: str, model: str, text: str, finish: str | None = None, **extra: Any) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
    body = {"id": rid, "object": "text_completion", "created": now(), "model": model}
    return {**body, "choices": [choice], **extra}


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def models_list(names: list[str], created: int) -> dict:
    data = [{"id": n, "object": "model", "created": created, "owned_by": "ragblend"} for n in names]
    return {"object": "list", "data": data}
