"""OpenAI-compatible request and response bodies (pydantic), plus ragblend's additions.

The shapes follow OpenAI's Chat Completions and (legacy) Completions APIs, as vLLM's
``entrypoints/openai/protocol.py`` does: unknown request fields are accepted (the app logs
them, :meth:`_Request.unknown_fields`); fields that would change the output but are not
supported are refused (:meth:`_Request.unsupported`); vLLM's ``ignore_eos``, ``top_k`` and
``repetition_penalty`` are honoured. ragblend adds ``"ragblend": {"mode": ...}`` to a request
and a ``ragblend`` object (:class:`RagblendInfo`) to every response.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ragblend.decode import BlendStats

ModeName = Literal["full", "prefix", "reuse", "blend"]


class RagblendOptions(BaseModel):
    """``"ragblend": {"mode": "full"}`` in a request body (OpenAI clients' ``extra_body``)."""

    model_config = ConfigDict(extra="forbid")
    mode: ModeName | None = None


class _Request(BaseModel):
    """The sampling fields both endpoints share."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    n: int = Field(default=1, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    ragblend: RagblendOptions | None = None

    def unsupported(self) -> list[str]:
        """The fields set to something that would change the output and is not supported."""
        bad = []
        if self.n > 1:
            bad.append("n")
        if self.logit_bias:
            bad.append("logit_bias")
        if self.response_format and self.response_format.get("type", "text") != "text":
            bad.append("response_format")
        return bad

    def unknown_fields(self) -> list[str]:
        """Fields this server does not know (accepted and ignored, as vLLM does)."""
        return sorted(self.model_extra or {})

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
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += [f for f in ("tools", "functions") if getattr(self, f)]
        bad += [f for f in ("tool_choice", "function_call") if getattr(self, f) not in NO_TOOL]
        return bad

    def logprobs_wanted(self) -> int | None:
        """None (no logprobs) or how many most likely tokens to list beside each one."""
        return (self.top_logprobs or 0) if self.logprobs else None


NO_TOOL = (None, "none", "auto")  # "auto" with no tools lets the model answer in text


class CompletionRequest(_Request):
    prompt: str | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def token_budget(self) -> int | None:
        return self.max_tokens

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        bad += ["echo"] if self.echo else []
        bad += ["suffix"] if self.suffix else []
        bad += ["best_of"] if (self.best_of or 1) > 1 else []
        return bad

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: a prompt, or chat messages rendered with the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="ignore")
    model: str
    tokens: list[int]


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
    fallback_message: str | None = None
    request_id: str | None = None

    @classmethod
    def of(cls, stats: BlendStats, request_id: str | None = None) -> RagblendInfo:
        return cls(
            mode=stats.mode,
            ttft_ms=round(stats.ttft_ms, 3),
            chunk_hits=stats.chunk_hits,
            chunk_misses=stats.chunk_misses,
            fallback_reason=stats.fallback_reason,
            fallback_message=stats.fallback_message,
            request_id=request_id,
        )


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the chunk or prefix caches


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, stats: BlendStats) -> Usage:
        prompt, completion = stats.prompt_tokens, stats.completion_tokens
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.cached_tokens),
        )


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def chat_response(
    rid: str,
    model: str,
    text: str,
    finish: str,
    stats: BlendStats,
    request_id: str | None = None,
    logprobs: dict | None = None,
) -> dict:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
    return _response(rid, "chat.completion", model, choice, stats, request_id)


def text_response(
    rid: str,
    model: str,
    text: str,
    finish: str,
    stats: BlendStats,
    request_id: str | None = None,
    logprobs: dict | None = None,
) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
    return _response(rid, "text_completion", model, choice, stats, request_id)


def _response(
    rid: str, kind: str, model: str, choice: dict, stats: BlendStats, request_id: str | None
) -> dict:
    return {
        "id": rid,
        "object": kind,
        "created": now(),
        "model": model,
        "choices": [choice],
        "usage": Usage.of(stats).model_dump(),
        "ragblend": RagblendInfo.of(stats, request_id).model_dump(),
    }


def _chunk(
    kind: str,
    rid: str,
    model: str,
    content: dict,
    finish: str | None,
    logprobs: dict | None,
    extra: dict[str, Any],
) -> dict:
    """One streamed event of ``kind`` whose single choice carries ``content``."""
    choice = {"index": 0, **content, "finish_reason": finish, "logprobs": logprobs}
    body = {"id": rid, "object": kind, "created": now(), "model": model}
    return {**body, "choices": [choice], **extra}


def chat_chunk(
    rid: str,
    model: str,
    delta: dict,
    finish: str | None = None,
    logprobs: dict | None = None,
    **extra: Any,
) -> dict:
    return _chunk("chat.completion.chunk", rid, model, {"delta": delta}, finish, logprobs, extra)


def text_chunk(
    rid: str,
    model: str,
    text: str,
    finish: str | None = None,
    logprobs: dict | None = None,
    **extra: Any,
) -> dict:
    return _chunk("text_completion", rid, model, {"text": text}, finish, logprobs, extra)


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def models_list(names: list[str], created: int) -> dict:
    data = [{"id": n, "object": "model", "created": created, "owned_by": "ragblend"} for n in names]
    return {"object": "list", "data": data}
