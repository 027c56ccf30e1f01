"""Stuff-mode response synthesis that keeps retrieved nodes as separate KV-cacheable chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT
from llama_index.core.prompts.mixin import PromptDictType
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.types import RESPONSE_TEXT_TYPE

from llama_index.llms.ragblend.base import BaseBlendLLM
from llama_index.llms.ragblend.prompts import qa_prompt_format
from ragblend import PromptFormat, RagblendError


class BlendSynthesizer(BaseSynthesizer):
    """LlamaIndex's stuff mode (``simple_summarize``) for a :class:`BlendLLM`, one engine call.

    Each retrieved node's ``get_content(metadata_mode=MetadataMode.LLM)`` text is passed as its
    own chunk, in retrieval order, so the engine can fuse the chunks' precomputed KV caches.
    The prompt text is what ``simple_summarize`` builds with the same QA template (LlamaIndex's
    chat QA prompt by default); unlike it, chunks are never truncated: a prompt longer than the
    context window raises :class:`ragblend.RagblendError`.
    """

    def __init__(
        self,
        llm: BaseBlendLLM,
        text_qa_template: BasePromptTemplate | None = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        mode: str | None = None,
        ratio: float | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(llm, BaseBlendLLM):
            raise RagblendError(f"BlendSynthesizer needs a BlendLLM, got {type(llm).__name__}")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming, **kwargs)
        self._blend_llm = llm
        self._text_qa_template = text_qa_template
        self._format = self._resolve_format(text_qa_template)
        self._mode = mode
        self._ratio = ratio

    def _resolve_format(self, template: BasePromptTemplate | None) -> PromptFormat:
        if template is None:
            return self._blend_llm.prompt_format
        return qa_prompt_format(template, self._blend_llm.system_prompt)

    @property
    def prompt_format(self) -> PromptFormat:
        """The layout used for the engine call (chunks between the template's prefix/suffix)."""
        return self._format

    def _get_prompts(self) -> PromptDictType:
        return {"text_qa_template": self._text_qa_template or CHAT_TEXT_QA_PROMPT}

    def _update_prompts(self, prompts: PromptDictType) -> None:
        if "text_qa_template" in prompts:
            self._text_qa_template = prompts["text_qa_template"]
            self._format = self._resolve_format(self._text_qa_template)

    def _call_kwargs(self, query_str: str, text_chunks: Sequence[str], extra: dict) -> dict:
        kwargs = {**extra, "chunks": list(text_chunks), "question": query_str}
        kwargs["prompt_format"] = self._format
        if self._mode is not None:
            kwargs.setdefault("mode", self._mode)
        if self._ratio is not None:
            kwargs.setdefault("ratio", self._ratio)
        return kwargs

    def _display_prompt(self, query_str: str, text_chunks: Sequence[str]) -> str:
        """The user message as text (what callbacks and instrumentation see as the prompt)."""
        return self._format.user_text(list(text_chunks), query_str)

    def get_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Answer over ``text_chunks`` (one chunk per retrieved node, in retrieval order)."""
        kwargs = self._call_kwargs(query_str, text_chunks, response_kwargs)
        prompt = self._display_prompt(query_str, text_chunks)
        if self._streaming:
            return _deltas(self._blend_llm.stream_complete(prompt, **kwargs))
        text = self._blend_llm.complete(prompt, **kwargs).text
        return text or self._empty_response

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        """Async :meth:`get_response`; the engine runs in a worker thread."""
        kwargs = self._call_kwargs(query_str, text_chunks, response_kwargs)
        prompt = self._display_prompt(query_str, text_chunks)
        if self._streaming:
            return _adeltas(await self._blend_llm.astream_complete(prompt, **kwargs))
        text = (await self._blend_llm.acomplete(prompt, **kwargs)).text
        return text or self._empty_response


def _deltas(responses: Iterator[Any]) -> Iterator[str]:
    for response in responses:
        if response.delta:
            yield response.delta


async def _adeltas(responses: AsyncIterator[Any]) -> AsyncIterator[str]:
    async for response in responses:
        if response.delta:
            yield response.delta
