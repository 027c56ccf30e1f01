"""OpenAI requests → tokenised generation jobs, with the chunks found in their text.

A request carries no chunk boundaries: its messages (or prompt) are searched for the texts of
known chunks (every chunk recorded with the engine's store, see ``BlendEngine.known_chunks``)
and split there (``ragblend.matching.chunked_prompt``), so any OpenAI client blends unchanged.
Every mode runs on those same ids; a request with no known chunk runs a full prefill of its
chat-template ids and says why (``fallback_reason`` ``"no_known_chunk"``, ``fallback_message``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ragblend.decode import SamplingParams
from ragblend.engine import BlendEngine
from ragblend.errors import RagblendError
from ragblend.fallback import NO_KNOWN_CHUNK
from ragblend.matching import chunked_prompt
from ragblend.prompt import TokenizedPrompt
from ragblend.serving.events import GenerationJob
from ragblend.serving.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

NO_CHUNK = (
    "no known chunk text occurs in the prompt: precompute the chunks first "
    "(POST /v1/ragblend/chunks or `ragblend warmup` into this server's store)"
)


@dataclass
class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with OpenAI's error fields."""

    message: str
    status: int = 400
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None

    def __str__(self) -> str:
        return self.message


@dataclass
class JobBuilder:
    """Turns requests into :class:`GenerationJob` for ``engine`` (tokeniser work only: this
    runs on request threads, never on the compute thread)."""

    engine: BlendEngine
    model_names: tuple[str, ...]
    default_max_tokens: int = 256

    def check_model(self, model: str) -> None:
        if model not in self.model_names:
            raise RequestError(
                f"The model `{model}` does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.model_names)}",
                status=404,
                code="model_not_found",
                param="model",
            )

    def chat(self, req: ChatCompletionRequest) -> GenerationJob:
        self.check_model(req.model)
        if req.top_logprobs and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        messages = _messages(req.messages)
        tok = self.engine.tokenizer
        try:
            found = chunked_prompt(tok, messages, index=self.engine.known_chunks(), retrieved=())
            ids = None if found is not None else self.engine.chat_ids(messages)
        except RagblendError:
            raise
        except Exception as exc:  # the chat template refused the conversation
            raise RequestError(f"cannot render the messages: {exc}", param="messages") from None
        return self._job(req, found, ids, req.token_budget())

    def tokenize(self, req: TokenizeRequest) -> list[int]:
        """``POST /tokenize``: the ids of ``prompt``, or of ``messages`` as the chat
        template renders them for generation."""
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give either prompt or messages", param="prompt")
        if req.prompt is not None:
            tok = self.engine.tokenizer
            return list(tok(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
        try:
            return list(self.engine.chat_ids(_messages(req.messages or [])))
        except Exception as exc:  # the chat template refused the conversation
            raise RequestError(f"cannot render the messages: {exc}", param="messages") from None

    def detokenize(self, req: DetokenizeRequest) -> str:
        """``POST /detokenize``: the text of ``tokens``."""
        self.check_model(req.model)
        vocab = len(self.engine.tokenizer)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise RequestError(f"token ids must be in [0, {vocab})", param="tokens")
        return self.engine.tokenizer.decode(req.tokens)

    def completion(self, req: CompletionRequest) -> GenerationJob:
        self.check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise RequestError("give one prompt per request", param="prompt")
            prompt = prompt[0]
        tok = self.engine.tokenizer
        found = chunked_prompt(
            tok, None, text=prompt, index=self.engine.known_chunks(), retrieved=()
        )
        ids = None if found is not None else list(tok(prompt)["input_ids"])
        return self._job(req, found, ids, req.token_budget())

    def _job(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        found: TokenizedPrompt | None,
        ids: list[int] | None,
        budget: int | None,
    ) -> GenerationJob:
        mode = (req.ragblend.mode if req.ragblend else None) or self.engine.config.mode
        prompt: TokenizedPrompt | list[int]
        fallback = None
        if found is not None:
            prompt = found
        else:
            prompt = ids or []
            fallback = NO_KNOWN_CHUNK if mode != "full" else None
        n = len(found) if found is not None else len(prompt)
        if not n:
            raise RequestError("the prompt is empty", param="messages")
        window = self.engine.context_window
        if window and n >= window:
            raise RequestError(
                f"This model's maximum context length is {window} tokens; the prompt has {n} "
                "tokens (no room for a completion). Send fewer or shorter chunks.",
                code="context_length_exceeded",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
            )
        max_tokens = budget or self.default_max_tokens
        if window:
            max_tokens = min(max_tokens, window - n)
        stop = req.stop_list()
        if len(stop) > 4:
            raise RequestError("at most 4 stop sequences", param="stop")
        try:
            params = SamplingParams(
                max_new_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                seed=req.seed,
                repetition_penalty=req.repetition_penalty or 1.0,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                stop=tuple(stop),
                ignore_eos=req.ignore_eos,
            )
        except RagblendError as exc:
            raise RequestError(str(exc)) from None
        return GenerationJob(
            prompt=prompt,
            mode=mode,
            params=params,
            max_tokens=max_tokens,
            fallback_reason=fallback,
            logprobs=req.logprobs_wanted(),
        )


def _messages(messages: list[ChatMessage]) -> list[dict]:
    return [{"role": _role(m.role), "content": m.text()} for m in messages]


def _role(role: str) -> str:
    return "system" if role == "developer" else role
