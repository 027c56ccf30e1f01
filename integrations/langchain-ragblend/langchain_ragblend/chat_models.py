"""ChatRagBlend: a LangChain chat model over a ragblend BlendEngine."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.prompts import BasePromptTemplate
from pydantic import ConfigDict, Field, PrivateAttr, model_validator
from ragblend import BlendConfig, BlendEngine, BlendResult, BlendStream, PromptFormat, RagblendError
from ragblend.bridge import aiter_in_thread
from ragblend.matching import chunked_prompt, fallback_message, known_chunks, mark_fallback
from ragblend.prompt import TokenizedPrompt, encode
from ragblend.warmup import BACKLOG, RETRIEVAL, WarmupPool

from langchain_ragblend.chunks import content_text, document_text, split_chunked_content
from langchain_ragblend.retrieved import RECORDER

log = logging.getLogger(__name__)

_GEN_OPTIONS = ("mode", "ratio", "max_new_tokens", "temperature", "top_p", "top_k", "seed")
_ENGINES: dict[tuple[str, str], BlendEngine] = {}
_ENGINES_LOCK = threading.Lock()


def shared_engine(model: str = "embedded", config: BlendConfig | None = None) -> BlendEngine:
    """Load ``model`` once per process and configuration, so instances share one KV store."""
    key = (str(model), repr(config))
    with _ENGINES_LOCK:
        if key not in _ENGINES:
            _ENGINES[key] = BlendEngine.from_pretrained(model, config=config)
        return _ENGINES[key]


@dataclass(frozen=True)
class ChunkLayout:
    """Where chunks sit in a prompt (system + user prefix decide their precompute context) and
    how a document is turned into chunk text."""

    prompt_format: PromptFormat
    document_prompt: BasePromptTemplate | None = None

    @property
    def head_key(self) -> tuple[str | None, str]:
        return (self.prompt_format.system, self.prompt_format.prefix)

    @property
    def key(self) -> tuple[str | None, str, str]:
        return (*self.head_key, repr(self.document_prompt))


@dataclass
class _Request:
    """One engine call: chunked (question, chunks, format) or plain chat messages."""

    options: dict[str, Any]
    chunks: list[str] = field(default_factory=list)
    question: str = ""
    prompt_format: PromptFormat | None = None
    chat: list[dict[str, str]] | None = None
    tokenized: TokenizedPrompt | None = None


class _StopFilter:
    """Cuts streamed text at the first stop sequence, holding back possible partial matches."""

    def __init__(self, stop: Sequence[str] | None) -> None:
        self.stop = [s for s in (stop or []) if s]
        self.buffer = ""
        self.emitted = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stop:
            return delta
        self.buffer += delta
        hits = [i for i in (self.buffer.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._emit(min(hits))
        hold = max(
            (n for s in self.stop for n in range(1, len(s)) if self.buffer.endswith(s[:n])),
            default=0,
        )
        return self._emit(len(self.buffer) - hold)

    def flush(self) -> str:
        return "" if self.stopped else self._emit(len(self.buffer))

    def _emit(self, end: int) -> str:
        out = self.buffer[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return out


def _role(message: BaseMessage) -> str:
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, ChatMessage):
        return message.role
    raise RagblendError(f"ChatRagBlend does not handle {type(message).__name__} messages")


class ChatRagBlend(BaseChatModel):
    """Chat model on a ragblend :class:`~ragblend.BlendEngine` (CacheBlend KV fusion).

    Retrieved documents reach the model as separate chunks, either as tagged content blocks in
    the human message (see :mod:`langchain_ragblend.chunks`, built for you by
    :func:`~langchain_ragblend.create_blend_stuff_chain`) or via ``.bind(chunks=[...])``, in
    which case the human message is the question, laid out by ``prompt_format``. Without
    chunks it is an ordinary local chat model (full prefill over the chat template).

    >>> llm = ChatRagBlend(model="embedded", max_new_tokens=32)
    >>> llm.bind(chunks=["Paris is the capital of France."]).invoke("Capital of France?")
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    model: str = "embedded"
    """``"embedded"`` (SmolLM2-135M-Instruct) or a local HF model directory."""
    engine: BlendEngine | None = Field(default=None, exclude=True)
    """An engine to use instead of loading ``model`` (shared per model and config otherwise)."""
    blend_config: BlendConfig | None = Field(default=None, exclude=True)
    """Engine configuration when ``model`` is loaded here."""
    mode: str | None = None
    """``blend`` (default of the engine's config), ``full``, ``prefix`` or ``reuse``."""
    ratio: float | None = None
    """Recompute ratio for blend; ``None`` uses the engine's default."""
    max_new_tokens: int | None = None
    """Tokens to generate at most; ``None`` uses the engine's default (also ``max_tokens=``)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    prompt_format: PromptFormat | None = Field(default=None, exclude=True)
    """Layout for ``chunks=`` calls and the default warmup layout (engine default if None)."""
    streaming: bool = False
    warmup_workers: int = 1

    _layouts: list[ChunkLayout] = PrivateAttr(default_factory=list)
    _pool: WarmupPool | None = PrivateAttr(default=None)
    _warm_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _warned_fallback: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _load_engine(self) -> ChatRagBlend:
        if self.engine is None:
            self.engine = shared_engine(self.model, self.blend_config)
        if self.prompt_format is None:
            self.prompt_format = self.engine.prompt_format
        return self

    # ------------------------------------------------------------------ LangChain plumbing
    @property
    def _llm_type(self) -> str:
        return "ragblend"

    @property
    def model_name(self) -> str:
        return self.engine.name

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "mode": self.mode or self.engine.config.mode,
            "ratio": self.ratio if self.ratio is not None else self.engine.config.ratio,
            "max_new_tokens": self._max_new_tokens(),
            "temperature": self.temperature,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="ragblend",
            ls_model_name=str(kwargs.get("model") or self.model_name),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get(
                "max_new_tokens", kwargs.get("max_tokens", self._max_new_tokens())
            ),
        )
        if stop:
            params["ls_stop"] = stop
        return params

    def _max_new_tokens(self) -> int:
        return self.max_new_tokens or self.engine.config.max_new_tokens

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids from the model's own tokenizer (no special tokens)."""
        return encode(self.engine.tokenizer, text)

    def get_num_tokens_from_messages(
        self, messages: list[BaseMessage], tools: Sequence[Any] | None = None
    ) -> int:
        """Prompt length of ``messages`` through the model's chat template."""
        if tools:
            raise RagblendError("ChatRagBlend does not support tools")
        chat = [{"role": _role(m), "content": content_text(m.content)} for m in messages]
        return len(self.engine.chat_ids(chat))

    # ------------------------------------------------------------------ requests
    def _prepare(
        self, messages: list[BaseMessage], kwargs: dict[str, Any], run_manager: Any = None
    ) -> _Request:
        """One engine call for ``messages``; ``run_manager`` finds what this query retrieved."""
        kwargs = dict(kwargs)
        if "max_tokens" in kwargs:
            kwargs.setdefault("max_new_tokens", kwargs.pop("max_tokens"))
        options = {k: kwargs.pop(k, getattr(self, k)) for k in _GEN_OPTIONS}
        options["max_new_tokens"] = options["max_new_tokens"] or self._max_new_tokens()
        chunks_kw = kwargs.pop("chunks", None)
        kwargs.pop("stream", None)
        if kwargs:
            raise RagblendError(f"unexpected arguments for ChatRagBlend: {', '.join(kwargs)}")
        split = [(i, split_chunked_content(m.content)) for i, m in enumerate(messages)]
        chunked = [(i, s) for i, s in split if s is not None]
        if len(chunked) > 1:
            raise RagblendError("only one message may carry chunks")
        if chunked or chunks_kw:
            system, user = self._chunk_turn(messages, chunked[0][0] if chunked else None)
            if chunked:
                if chunks_kw:
                    raise RagblendError("pass chunks either as content blocks or as chunks=")
                parts = chunked[0][1]
                # the suffix is laid out verbatim: it takes the place of the question
                fmt = PromptFormat(system, parts.prefix, parts.separator, "{question}")
                return _Request(options, parts.chunks, parts.suffix, fmt)
            chunks = [document_text(c) for c in chunks_kw]
            fmt = self.prompt_format
            if system is not None:
                fmt = replace(fmt, system=system)
            return _Request(options, chunks, content_text(user.content), fmt)
        chat = [{"role": _role(m), "content": content_text(m.content)} for m in messages]
        if options["mode"] in ("reuse", "blend") or (
            options["mode"] is None and self.engine.config.mode in ("reuse", "blend")
        ):
            # plain text (format_docs, stuff chains): split at known or retrieved chunk texts
            retrieved = RECORDER.retrieved_for(run_manager.run_id) if run_manager else ()
            prompt = chunked_prompt(
                self.engine.tokenizer, chat, index=self.engine.known_chunks(), retrieved=retrieved
            )
            if prompt is not None:
                return _Request(options, chat=chat, tokenized=prompt)
        return _Request(options, chat=chat)

    @staticmethod
    def _chunk_turn(
        messages: list[BaseMessage], index: int | None
    ) -> tuple[str | None, BaseMessage]:
        """(system text, user message) of a chunked request: [system] + one human message."""
        body = list(messages)
        system = None
        if body and isinstance(body[0], SystemMessage):
            system = content_text(body.pop(0).content)
        wrong_place = index is not None and index != len(messages) - 1
        if len(body) != 1 or _role(body[0]) != "user" or wrong_place:
            raise RagblendError(
                "with chunks, send an optional system message and one human message "
                f"(got {[_role(m) for m in messages]}); chunks go in the human message"
            )
        return system, body[0]

    def _open(self, req: _Request) -> BlendStream:
        opts = req.options
        if req.tokenized is not None:
            sampling = {k: opts[k] for k in _GEN_OPTIONS if k not in ("mode", "ratio")}
            return self.engine.stream_prompt(req.tokenized, opts["mode"], opts["ratio"], **sampling)
        if req.chat is not None:
            sampling = {k: opts[k] for k in _GEN_OPTIONS if k not in ("mode", "ratio")}
            return self.engine.stream_prompt(self.engine.chat_ids(req.chat), **sampling)
        return self.engine.stream(req.question, req.chunks, prompt_format=req.prompt_format, **opts)

    def _iter_chunks(
        self,
        req: _Request,
        stop: list[str] | None,
        cancel: threading.Event | None = None,
    ) -> Iterator[ChatGenerationChunk]:
        """Text chunks as decoded, then one last chunk carrying usage and response metadata."""
        pool = self._pool  # background warmup (if any) starts no new chunk meanwhile
        with pool.query() if pool is not None else contextlib.nullcontext():
            yield from self._decode_chunks(req, stop, cancel)
        if req.tokenized is not None:  # queued after the call, not while it runs
            self._warm_missing(req.tokenized.chunk_texts)

    def _decode_chunks(
        self, req: _Request, stop: list[str] | None, cancel: threading.Event | None
    ) -> Iterator[ChatGenerationChunk]:
        stops = _StopFilter(stop)
        stream = self._open(req)
        for delta in stream:
            if cancel is not None and cancel.is_set():
                stream.close()
                return
            text = stops.feed(delta)
            if text:
                yield ChatGenerationChunk(message=AIMessageChunk(content=text))
            if stops.stopped:  # decoding ends at the stop sequence
                stream.close()
                break
        text = stops.flush()
        if text:
            yield ChatGenerationChunk(message=AIMessageChunk(content=text))
        yield self._last_chunk(stream.result, stops, req)

    def _kept_tokens(self, result: BlendResult, kept_chars: int) -> int:
        """Generated tokens needed to produce the kept text (a stop sequence cut the rest)."""
        ids = result.token_ids
        for n in range(len(ids) + 1):
            if len(self.engine.tokenizer.decode(ids[:n], skip_special_tokens=True)) >= kept_chars:
                return n
        return len(ids)

    def _last_chunk(
        self, result: BlendResult, stops: _StopFilter, req: _Request
    ) -> ChatGenerationChunk:
        stats = result.stats
        finish = "stop" if stops.stopped else stats.finish_reason
        if stops.stopped:
            stats.completion_tokens = self._kept_tokens(result, stops.emitted)
        requested = req.options.get("mode") or self.engine.config.mode
        reason = mark_fallback(stats, requested)
        if reason is not None and not self._warned_fallback:
            self._warned_fallback = True
            log.warning(fallback_message("ChatRagBlend", reason))
        metadata = {
            "model_name": self.model_name,
            "finish_reason": finish,
            "ttft_ms": stats.ttft_ms,
            "mode": stats.mode,
            "recomputed_fraction": stats.recomputed_fraction,
            "ratio": stats.ratio,
            "chunk_hits": stats.chunk_hits,
            "chunk_misses": stats.chunk_misses,
            "decode_ms": stats.decode_ms,
            "fallback_reason": stats.extra.get("fallback_reason"),
        }
        usage = UsageMetadata(
            input_tokens=stats.prompt_tokens,
            output_tokens=stats.completion_tokens,
            total_tokens=stats.prompt_tokens + stats.completion_tokens,
        )
        message = AIMessageChunk(
            content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last"
        )
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": finish})

    @staticmethod
    def _result(chunks: list[ChatGenerationChunk]) -> ChatResult:
        last = chunks[-1].message
        message = AIMessage(
            content="".join(str(c.message.content) for c in chunks),
            usage_metadata=last.usage_metadata,
            response_metadata=dict(last.response_metadata),
        )
        generation = ChatGeneration(message=message, generation_info=chunks[-1].generation_info)
        llm_output = {"model_name": last.response_metadata["model_name"]}
        return ChatResult(generations=[generation], llm_output=llm_output)

    # ------------------------------------------------------------------ sync API
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        req = self._prepare(messages, kwargs, run_manager)
        return self._result(list(self._iter_chunks(req, stop)))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._iter_chunks(self._prepare(messages, kwargs, run_manager), stop):
            if run_manager is not None:
                run_manager.on_llm_new_token(str(chunk.message.content), chunk=chunk)
            yield chunk

    # ------------------------------------------------------------------ async API
    async def _achunks(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        kwargs: dict[str, Any],
        run_manager: Any = None,
    ) -> AsyncIterator[ChatGenerationChunk]:
        """Run the engine on a worker thread; hand its chunks to the event loop via a queue."""
        req = self._prepare(messages, kwargs, run_manager)
        chunks = aiter_in_thread(
            lambda cancel: self._iter_chunks(req, stop, cancel), name="ragblend-generate"
        )
        async for chunk in chunks:
            yield chunk

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return self._result([c async for c in self._achunks(messages, stop, kwargs, run_manager)])

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in self._achunks(messages, stop, kwargs, run_manager):
            if run_manager is not None:
                await run_manager.on_llm_new_token(str(chunk.message.content), chunk=chunk)
            yield chunk

    # ------------------------------------------------------------------ KV warmup
    def register_layout(
        self, prompt_format: PromptFormat, document_prompt: BasePromptTemplate | None = None
    ) -> None:
        """Record a chunk layout used with this model, so warmup precomputes for it.

        Chains built by :func:`create_blend_stuff_chain` register theirs; until one is
        registered, warmup uses ``prompt_format`` with ``{page_content}`` documents.
        """
        layout = ChunkLayout(prompt_format, document_prompt)
        with self._warm_lock:
            if all(existing.key != layout.key for existing in self._layouts):
                self._layouts.append(layout)

    @property
    def layouts(self) -> list[ChunkLayout]:
        """The chunk layouts warmup precomputes for."""
        with self._warm_lock:
            return list(self._layouts) or [ChunkLayout(self.prompt_format)]

    @property
    def warmup_pool(self) -> WarmupPool:
        """The core background precompute pool (one for every layout; created on first use)."""
        with self._warm_lock:
            if self._pool is None:
                self._pool = WarmupPool(self.engine, workers=self.warmup_workers)
            return self._pool

    def is_cached(self, doc: Document | str) -> bool:
        """Whether a document's chunk KV is stored for every registered layout."""
        return all(
            self.engine.is_cached(document_text(doc, lay.document_prompt), lay.prompt_format)
            for lay in self.layouts
        )

    def warm(self, documents: Iterable[Document | str]) -> list[str]:
        """Enqueue the documents whose chunk KV is not stored yet for background precompute.

        Returns the chunk texts newly enqueued (already stored or queued ones are skipped).
        """
        return self._warm(documents, BACKLOG)

    def warm_retrieved(self, documents: Iterable[Document | str]) -> list[str]:
        """Like :meth:`warm`, queued before the ingestion backlog (retrieval-time misses)."""
        return self._warm(documents, RETRIEVAL)

    def _warm_missing(self, texts: Sequence[str]) -> None:
        """Queue the matched chunks that are not stored before the backlog (the next query
        retrieving them hits); nothing is queued, and no pool started, when all are stored."""
        if any(not self.engine.is_cached(t, self.prompt_format) for t in texts):
            self._warm(texts, RETRIEVAL)

    def _warm(self, documents: Iterable[Document | str], priority: int) -> list[str]:
        docs = list(documents)
        pool = self.warmup_pool
        enqueued: list[str] = []
        for layout in self.layouts:
            texts = [document_text(doc, layout.document_prompt) for doc in docs]
            known_chunks(self.engine).add(texts)  # matched in prompts even when already stored
            for text in texts:
                if not text.strip() or pool.is_cached(text, layout.prompt_format):
                    continue
                if pool.warm([text], layout.prompt_format, priority=priority):
                    enqueued.append(text)
        return enqueued

    def wait_for_warmup(self) -> None:
        """Block until every enqueued precompute has finished."""
        if self._pool is not None:
            self._pool.wait()

    def close(self, wait: bool = True) -> None:
        """Stop the warmup workers (finishing queued work when ``wait``)."""
        with self._warm_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(wait=wait)
