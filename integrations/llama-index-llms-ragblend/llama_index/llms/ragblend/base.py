"""BlendLLM: a LlamaIndex LLM over a ragblend BlendEngine."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from llama_index.llms.ragblend.prompts import qa_prompt_format
from llama_index.llms.ragblend.recorder import install_retrieval_recorder
from ragblend import BlendConfig, BlendEngine, BlendResult, BlendStats, PromptFormat
from ragblend.bridge import aiter_in_thread
from ragblend.config import MODES
from ragblend.errors import RagblendError
from ragblend.matching import (
    chunked_prompt,
    fallback_message,
    mark_fallback,
    prompt_forms,
)
from ragblend.prompt import encode
from ragblend.threads import run_in_fresh_thread
from ragblend.warmup import BACKLOG, RETRIEVAL, WarmupPool

log = logging.getLogger(__name__)


def node_texts(nodes: Iterable[BaseNode | NodeWithScore], escaped_forms: bool = False) -> list[str]:
    """The texts a node appears as in prompts: its LLM-mode content (what the synthesizer and
    refine send) and that content stripped (what compact mode packs), without duplicates.

    ``escaped_forms`` adds the forms the content takes inside ``simple_summarize``'s prompt,
    which formats the context as a Python list (newlines and quotes escaped).
    """
    texts: list[str] = []
    for node in nodes:
        text = node.get_content(metadata_mode=MetadataMode.LLM)
        forms = prompt_forms(text) if escaped_forms else [text]
        for variant in (*forms, text.strip()):
            if variant and variant not in texts:
                texts.append(variant)
    return texts


_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
}


class BaseBlendLLM(CustomLLM):
    """LlamaIndex LLM on a ragblend :class:`BlendEngine` (CacheBlend KV fusion for RAG).

    Without chunks it is a plain local chat model (full prefill). Retrieved chunks reach the
    engine as text (plain ``index.as_query_engine()``: the texts of known chunks are found in
    the prompt, :mod:`ragblend.matching`) or through
    :func:`~llama_index.llms.ragblend.query_engine.blend_query_engine`, which passes each node
    as its own chunk; either way precomputed chunk KV caches are fused instead of prefilled.

    >>> Settings.llm = BlendLLM("embedded")            # or a local HF dir, or engine=...
    >>> query_engine = index.as_query_engine(similarity_top_k=6)
    """

    model: str = Field(default="embedded", description="Model path or 'embedded'.")
    mode: str = Field(default="blend", description="Engine mode: full, prefix, reuse, blend.")
    ratio: float | None = Field(
        default=None, description="Recompute ratio for blend mode (None: engine default)."
    )
    max_new_tokens: int | None = Field(
        default=None, description="Tokens generated per call (None: engine default)."
    )
    temperature: float = Field(default=0.0, ge=0.0, description="0 means greedy decoding.")

    _engine: BlendEngine = PrivateAttr()
    _prompt_format: PromptFormat = PrivateAttr()
    _warmup: WarmupPool | None = PrivateAttr(default=None)
    _warmup_lock: Any = PrivateAttr(default_factory=threading.Lock)
    _last_stats: BlendStats | None = PrivateAttr(default=None)
    _warned_fallback: bool = PrivateAttr(default=False)

    def __init__(
        self,
        model: str = "embedded",
        *,
        engine: BlendEngine | None = None,
        config: BlendConfig | None = None,
        mode: str | None = None,
        ratio: float | None = None,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        text_qa_template: BasePromptTemplate | None = None,
        **kwargs: Any,
    ) -> None:
        """Load ``model`` (or wrap ``engine``); ``text_qa_template`` sets the RAG prompt layout."""
        if engine is None:
            engine = BlendEngine.from_pretrained(model, config=config)
        elif config is not None:
            raise RagblendError("pass either an engine or a config, not both")
        mode = mode or engine.config.mode
        if mode not in MODES:
            raise RagblendError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
        super().__init__(
            model=engine.name,
            mode=mode,
            ratio=ratio,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            **kwargs,
        )
        self._engine = engine
        self._prompt_format = qa_prompt_format(text_qa_template, self.system_prompt)
        install_retrieval_recorder()

    @classmethod
    def class_name(cls) -> str:
        return "ragblend_llm"

    # ------------------------------------------------------------------ properties
    @property
    def engine(self) -> BlendEngine:
        """The wrapped engine (share it between BlendLLMs with ``engine=llm.engine``)."""
        return self._engine

    @property
    def prompt_format(self) -> PromptFormat:
        """Layout of RAG prompts (LlamaIndex's QA template); warmup precomputes in its context."""
        return self._prompt_format

    @property
    def last_stats(self) -> BlendStats | None:
        """Stats of the most recent call that finished (TTFT, hits, recomputed fraction)."""
        return self._last_stats

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._engine.context_window,
            num_output=self._max_new(),
            is_chat_model=True,
            is_function_calling_model=False,
            model_name=self._engine.name,
        )

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` with the engine's tokenizer (e.g. for TokenCountingHandler)."""
        return encode(self._engine.tokenizer, text)

    # ------------------------------------------------------------------ engine calls
    def _max_new(self, kwargs: dict | None = None) -> int:
        value = (kwargs or {}).get("max_new_tokens", self.max_new_tokens)
        return self._engine.config.max_new_tokens if value is None else int(value)

    def _decoding(self, kwargs: dict) -> dict:
        return {
            "max_new_tokens": self._max_new(kwargs),
            "temperature": float(kwargs.get("temperature", self.temperature)),
            "top_p": float(kwargs.get("top_p", 1.0)),
            "top_k": int(kwargs.get("top_k", 0)),
            "seed": kwargs.get("seed"),
        }

    def _open_completion(self, prompt: str, formatted: bool, kwargs: dict) -> Any:
        """Start an engine stream: fused over ``chunks`` when given, else a full prefill."""
        stream = self._open_engine(prompt, formatted, kwargs)
        stream.requested_mode = kwargs.get("mode", self.mode)
        return stream

    def _open_engine(self, prompt: str, formatted: bool, kwargs: dict) -> Any:
        chunks = kwargs.get("chunks")
        if chunks is not None:
            question = kwargs.get("question")
            if question is None:
                raise RagblendError("chunks were given without the question")
            return self._engine.stream(
                question,
                list(chunks),
                mode=kwargs.get("mode", self.mode),
                ratio=kwargs.get("ratio", self.ratio),
                prompt_format=kwargs.get("prompt_format") or self._prompt_format,
                **self._decoding(kwargs),
            )
        if formatted:
            return self._open_text(None, prompt, kwargs)
        messages = [ChatMessage(role=MessageRole.USER, content=prompt)]
        return self._open_text(self._chat_dicts(messages, add_system=True), None, kwargs)

    def _open_chat(self, messages: Sequence[ChatMessage], kwargs: dict) -> Any:
        stream = self._open_text(self._chat_dicts(messages), None, kwargs)
        stream.requested_mode = kwargs.get("mode", self.mode)
        return stream

    def _open_text(self, chat: list[dict] | None, text: str | None, kwargs: dict) -> Any:
        """A text prompt: split at the known chunks it contains and fuse them (blend/reuse),
        else a full prefill over the chat template (or the raw ``text``)."""
        mode = kwargs.get("mode", self.mode)
        if mode in ("reuse", "blend"):
            tokenizer = self._engine.tokenizer
            prompt = chunked_prompt(tokenizer, chat, text, index=self._engine.known_chunks())
            if prompt is not None:
                ratio = kwargs.get("ratio", self.ratio)
                stream = self._engine.stream_prompt(prompt, mode, ratio, **self._decoding(kwargs))
                stream.matched_chunks = prompt.chunk_texts  # warmed after the call if missing
                return stream
        if chat is None:
            ids = list(self._engine.tokenizer(text)["input_ids"])
        else:
            ids = self._engine.chat_ids(chat)
        return self._engine.stream_prompt(ids, **self._decoding(kwargs))

    def _result(self, stream: Any) -> BlendResult:
        """The finished stream's result; then queue its matched chunks that are not stored
        (e.g. a chunk in a form never warmed, such as ``simple_summarize``'s escaped list)
        ahead of the backlog, so the next query hits. Queued after the call, not during it."""
        missing = [t for t in getattr(stream, "matched_chunks", ()) if not self.is_cached(t)]
        if missing:
            self.warmup(missing, only_missing=True)
        return _result_of(stream)

    def _chat_dicts(self, messages: Sequence[ChatMessage], add_system: bool = False) -> list:
        out = [{"role": _ROLES.get(m.role, "user"), "content": m.content or ""} for m in messages]
        if add_system and self.system_prompt and not any(m["role"] == "system" for m in out):
            out.insert(0, {"role": "system", "content": self.system_prompt})
        return out

    def _querying(self) -> Any:
        """While a query decodes, background warmup starts no new chunk."""
        pool = self._warmup
        return pool.query() if pool is not None else contextlib.nullcontext()

    def _drain(self, stream: Any) -> BlendResult:
        with self._querying():
            for _ in stream:
                pass
        return self._result(stream)

    def _finish(self, result: BlendResult) -> dict:
        """Record the stats; usage in the shape TokenCountingHandler reads (``raw['usage']``).

        A blend/reuse call that fused no chunk reports ``mode="full"`` and
        ``extra["fallback_reason"]``, and warns once per instance.
        """
        stats = result.stats
        reason = mark_fallback(stats, stats.extra.get("requested_mode") or self.mode)
        if reason is not None and not self._warned_fallback:
            self._warned_fallback = True
            log.warning(fallback_message("BlendLLM", reason))
        self._last_stats = stats
        usage = {
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        }
        return {"usage": usage, "ragblend": stats.as_dict()}

    def _completion(self, result: BlendResult, delta: str | None = None) -> CompletionResponse:
        raw = self._finish(result)
        return CompletionResponse(
            text=result.text, delta=delta, raw=raw, additional_kwargs=dict(raw["usage"])
        )

    def _chat_response(self, result: BlendResult, delta: str | None = None) -> ChatResponse:
        raw = self._finish(result)
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text),
            delta=delta,
            raw=raw,
            additional_kwargs=dict(raw["usage"]),
        )

    def _completion_gen(self, stream: Any) -> Iterator[CompletionResponse]:
        text = ""
        with self._querying():
            for delta in stream:
                text += delta
                yield CompletionResponse(text=text, delta=delta)
        yield self._completion(self._result(stream), delta="")

    def _chat_gen(self, stream: Any) -> Iterator[ChatResponse]:
        text = ""
        with self._querying():
            for delta in stream:
                text += delta
                message = ChatMessage(role=MessageRole.ASSISTANT, content=text)
                yield ChatResponse(message=message, delta=delta)
        yield self._chat_response(self._result(stream), delta="")

    # ------------------------------------------------------------------ sync API
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """Complete ``prompt``; with ``chunks=[...]`` and ``question=...`` fuse chunk caches."""
        return self._completion(self._drain(self._open_completion(prompt, formatted, kwargs)))

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        """Stream a completion; the last response (empty delta) carries usage and stats."""
        return self._completion_gen(self._open_completion(prompt, formatted, kwargs))

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        """Chat through the model's own chat template (full prefill)."""
        return self._chat_response(self._drain(self._open_chat(messages, kwargs)))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._chat_gen(self._open_chat(messages, kwargs))

    # ------------------------------------------------------------------ async API
    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        """Like :meth:`complete`, run in a worker thread so the event loop stays free."""
        stream = await run_in_fresh_thread(self._open_completion, prompt, formatted, kwargs)
        return self._completion(await run_in_fresh_thread(self._drain, stream))

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        """Async stream; prefill and decode run in a thread feeding an asyncio queue."""
        stream = await run_in_fresh_thread(self._open_completion, prompt, formatted, kwargs)
        return _athread(self._completion_gen(stream))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        stream = await run_in_fresh_thread(self._open_chat, messages, kwargs)
        return self._chat_response(await run_in_fresh_thread(self._drain, stream))

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        stream = await run_in_fresh_thread(self._open_chat, messages, kwargs)
        return _athread(self._chat_gen(stream))

    # ------------------------------------------------------------------ warmup
    @property
    def warmup_queue(self) -> WarmupPool:
        """The core background precompute pool (created on first use)."""
        with self._warmup_lock:
            if self._warmup is None:
                self._warmup = WarmupPool(self._engine)
            return self._warmup

    def warmup(self, texts: Iterable[str], only_missing: bool = False) -> int:
        """Enqueue texts for background KV precompute in this LLM's prompt layout.

        ``only_missing`` (retrieval-time warmup) skips stored texts and queues the rest before
        the ingestion backlog. Returns how many were enqueued.
        """
        priority = RETRIEVAL if only_missing else BACKLOG
        return self.warmup_queue.warm(
            texts, self._prompt_format, priority=priority, only_missing=only_missing
        )

    def warmup_nodes(
        self,
        nodes: Iterable[BaseNode | NodeWithScore],
        only_missing: bool = False,
        escaped_forms: bool = False,
    ) -> int:
        """Enqueue nodes' LLM-mode texts (what the synthesizer will send) for precompute;
        ``escaped_forms`` also the forms ``simple_summarize`` sends (see :func:`node_texts`)."""
        nodes = list(nodes)
        if self._engine.config.precompute_context == "neighbours":
            self._add_embeddings(nodes, escaped_forms)
        texts = node_texts(nodes, escaped_forms=escaped_forms)
        return self.warmup(texts, only_missing=only_missing)

    def _add_embeddings(self, nodes: list[BaseNode | NodeWithScore], escaped_forms: bool) -> None:
        """Nodes' embeddings (set when the embedding step ran before warmup) make each of their
        prompt forms known to the engine as a neighbour (``precompute_context="neighbours"``)."""
        texts: list[str] = []
        vectors: list[list[float]] = []
        for item in nodes:
            node = item.node if isinstance(item, NodeWithScore) else item
            if node.embedding is not None:
                forms = node_texts([node], escaped_forms=escaped_forms)
                texts += forms
                vectors += [node.embedding] * len(forms)
        if texts:
            self._engine.add_embeddings(texts, vectors)

    def is_cached(self, text: str) -> bool:
        """Whether ``text``'s chunk KV is in the store, in this LLM's prompt context."""
        return self._engine.is_cached(text, prompt_format=self._prompt_format)

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Block until queued warmup is done (or ``timeout`` s pass); True when all done."""
        if self._warmup is None:
            return True
        return self._warmup.wait(timeout)

    def close(self) -> None:
        """Stop the warmup workers (finishing queued work)."""
        with self._warmup_lock:
            queue, self._warmup = self._warmup, None
        if queue is not None:
            queue.close()


def _result_of(stream: Any) -> BlendResult:
    """The stream's result, its stats noting the mode the caller asked for."""
    result = stream.result
    result.stats.extra.setdefault("requested_mode", getattr(stream, "requested_mode", None))
    return result


def _athread(gen: Iterator[Any]) -> AsyncIterator[Any]:
    """Iterate a blocking generator asynchronously (core thread → asyncio bridge)."""
    return aiter_in_thread(lambda _cancel: gen, name="ragblend-llamaindex-stream")
