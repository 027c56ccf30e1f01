"""LCEL chains that hand retrieved documents to the model as separate chunks.

They mirror LangChain's classic ``create_stuff_documents_chain`` / ``create_retrieval_chain``:
same inputs, same outputs and the same prompt text (documents formatted with the document
prompt, joined by the separator, put in the prompt's ``{context}``), except that the human
message carries each document as a tagged chunk block instead of one joined string.
"""

from __future__ import annotations

import logging
import string
from typing import Any

from langchain_core.documents import Document
from langchain_core.language_models import BaseLanguageModel
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage
from langchain_core.output_parsers import BaseOutputParser, StrOutputParser
from langchain_core.prompt_values import ChatPromptValue
from langchain_core.prompts import BasePromptTemplate, ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import Runnable, RunnableBinding, RunnableLambda, RunnablePassthrough
from ragblend import PromptFormat, RagblendError

from langchain_ragblend.chat_models import ChatRagBlend
from langchain_ragblend.chunks import (
    DEFAULT_DOCUMENT_PROMPT,
    DEFAULT_DOCUMENT_SEPARATOR,
    chunk_blocks,
    content_text,
    document_text,
)

log = logging.getLogger(__name__)

DOCUMENTS_KEY = "context"
_CONTEXT_MARK = "\ue000ragblend:context\ue000"
_VALUE_MARK = "\ue001ragblend:value\ue001"


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def default_blend_prompt(prompt_format: PromptFormat | None = None) -> ChatPromptTemplate:
    """A ragblend layout (default: ragblend's own) as a chat prompt: the system prompt, then
    the prefix, ``{context}`` and the suffix with ``{input}`` as the human message."""
    fmt = prompt_format or PromptFormat()
    suffix = "".join(  # fmt.suffix is a str.format template: its {question} becomes {input}
        _escape(literal) + ("{input}" if name == "question" else "")
        for literal, name, _, _ in string.Formatter().parse(fmt.suffix)
    )
    human = _escape(fmt.prefix) + "{context}" + suffix
    messages: list[tuple[str, str]] = []
    if fmt.system is not None:
        messages.append(("system", _escape(fmt.system)))
    messages.append(("human", human))
    return ChatPromptTemplate.from_messages(messages)


def _alias_question(values: dict[str, Any], needed: list[str]) -> dict[str, Any]:
    """Accept ``question`` for a prompt that wants ``input`` and the other way round."""
    values = dict(values)
    for want, alt in (("input", "question"), ("question", "input")):
        if want in needed and want not in values and alt in values:
            values[want] = values[alt]
    return values


def _split_marked(messages: list[BaseMessage]) -> tuple[int, str, str]:
    """(index, text before, text after) of the one human message holding the context mark."""
    found = [
        (i, content_text(m.content))
        for i, m in enumerate(messages)
        if _CONTEXT_MARK in content_text(m.content)
    ]
    if len(found) != 1 or found[0][1].count(_CONTEXT_MARK) != 1:
        raise RagblendError("the prompt must place the documents variable exactly once")
    index, text = found[0]
    if not isinstance(messages[index], HumanMessage):
        raise RagblendError(
            "ChatRagBlend reuses chunk caches in the human message: put the documents variable "
            f"(e.g. {{context}}) in the human message, not in a {messages[index].type} message"
        )
    before, after = text.split(_CONTEXT_MARK)
    return index, before, after


def blend_prompt_format(
    prompt: BasePromptTemplate,
    document_variable_name: str = DOCUMENTS_KEY,
    document_separator: str = DEFAULT_DOCUMENT_SEPARATOR,
) -> PromptFormat | None:
    """The :class:`~ragblend.PromptFormat` a stuff prompt produces, for precomputing chunks.

    Equals ``PromptFormat.from_template(human_template, context_var=..., question_var=...,
    system=system_text)`` for a plain system + human prompt. ``None`` when the system text or
    the text before the documents depends on other inputs (no fixed precompute context).
    """
    values = {name: _VALUE_MARK for name in prompt.input_variables}
    values[document_variable_name] = _CONTEXT_MARK
    try:
        messages = prompt.format_prompt(**values).to_messages()
    except Exception as exc:  # e.g. a messages placeholder that needs a list
        log.info("cannot derive a fixed chunk layout from the prompt: %s", exc)
        return None
    index, before, after = _split_marked(messages)
    system = None
    head = messages[:index]
    if head and isinstance(head[0], SystemMessage):
        system = content_text(head.pop(0).content)
    if head or _VALUE_MARK in before or _VALUE_MARK in (system or ""):
        return None
    suffix = _escape(after).replace(_VALUE_MARK, "{question}")
    return PromptFormat(system, before, document_separator, suffix)


def _find_blend_model(llm: Any) -> ChatRagBlend | None:
    while isinstance(llm, RunnableBinding):
        llm = llm.bound
    return llm if isinstance(llm, ChatRagBlend) else None


def create_blend_stuff_chain(
    llm: Runnable,
    prompt: BasePromptTemplate | None = None,
    *,
    output_parser: BaseOutputParser | None = None,
    document_prompt: BasePromptTemplate | None = None,
    document_separator: str = DEFAULT_DOCUMENT_SEPARATOR,
    document_variable_name: str = DOCUMENTS_KEY,
) -> Runnable[dict[str, Any], Any]:
    """Like classic ``create_stuff_documents_chain``, with each document as its own chunk.

    Input: ``{"input" or "question": str, "context": list[Document], ...}``; output: the
    parsed answer (a string by default). ``prompt`` defaults to :func:`default_blend_prompt`
    of the model's ``prompt_format``. The chain registers its layout with the
    :class:`ChatRagBlend` under ``llm`` (also through ``.bind(...)``) so warmup precomputes
    chunks for this prompt.
    """
    model = _find_blend_model(llm)
    if prompt is None:
        prompt = default_blend_prompt(model.prompt_format if model is not None else None)
    if document_variable_name not in prompt.input_variables:
        raise RagblendError(
            f"the prompt must have the input variable {document_variable_name!r}; "
            f"it has {prompt.input_variables}"
        )
    fmt = blend_prompt_format(prompt, document_variable_name, document_separator)
    if model is not None and fmt is not None:
        model.register_layout(fmt, document_prompt)
    elif model is not None:
        log.warning("the prompt's text before the documents varies per call: no KV warmup")
    needed = list(prompt.input_variables)

    def format_inputs(inputs: dict[str, Any]) -> ChatPromptValue:
        values = _alias_question(inputs, needed)
        docs: list[Document] = list(values.get(document_variable_name) or [])
        if not docs:  # nothing retrieved: the plain prompt, exactly as the classic chain
            values[document_variable_name] = ""
            return ChatPromptValue(messages=prompt.format_prompt(**values).to_messages())
        values[document_variable_name] = _CONTEXT_MARK
        messages = prompt.format_prompt(**values).to_messages()
        index, before, after = _split_marked(messages)
        blocks = chunk_blocks(docs, before, after, document_separator, document_prompt)
        original = messages[index]
        messages[index] = HumanMessage(content=blocks, name=original.name, id=original.id)
        return ChatPromptValue(messages=messages)

    parser = output_parser or StrOutputParser()
    chain = RunnableLambda(format_inputs, name="format_inputs") | llm | parser
    return chain.with_config(run_name="blend_stuff_documents_chain")


def stuff_messages(
    prompt: BasePromptTemplate,
    inputs: dict[str, Any],
    document_prompt: BasePromptTemplate | None = None,
    document_separator: str = DEFAULT_DOCUMENT_SEPARATOR,
    document_variable_name: str = DOCUMENTS_KEY,
) -> list[BaseMessage]:
    """The messages classic ``create_stuff_documents_chain`` would send (joined documents)."""
    values = _alias_question(inputs, list(prompt.input_variables))
    docs = values.get(document_variable_name) or []
    values[document_variable_name] = document_separator.join(
        document_text(d, document_prompt or DEFAULT_DOCUMENT_PROMPT) for d in docs
    )
    return prompt.format_prompt(**values).to_messages()


def create_blend_retrieval_chain(
    retriever: Runnable,
    llm: Runnable,
    prompt: BasePromptTemplate | None = None,
    **stuff_kwargs: Any,
) -> Runnable[dict[str, Any], dict[str, Any]]:
    """Like classic ``create_retrieval_chain``: ``{"input": q}`` → ``{..., "context", "answer"}``.

    ``llm`` is a chat model (wrapped in :func:`create_blend_stuff_chain` with ``prompt``) or an
    already built combine-documents runnable. A :class:`BaseRetriever` is given the ``input``
    (or ``question``) string; any other runnable gets the whole input dict.
    """
    model = llm
    while isinstance(model, RunnableBinding):
        model = model.bound
    if isinstance(model, BaseLanguageModel):
        combine = create_blend_stuff_chain(llm, prompt, **stuff_kwargs)
    elif prompt is not None or stuff_kwargs:
        raise RagblendError("prompt and stuff-chain options apply only when llm is a chat model")
    else:
        combine = llm
    if isinstance(retriever, BaseRetriever):
        docs: Runnable = RunnableLambda(_query, name="query") | retriever
    else:
        docs = retriever
    chain = RunnablePassthrough.assign(
        context=docs.with_config(run_name="retrieve_documents")
    ).assign(answer=combine)
    return chain.with_config(run_name="retrieval_chain")


def _query(inputs: dict[str, Any]) -> str:
    if "input" in inputs:
        return inputs["input"]
    if "question" in inputs:
        return inputs["question"]
    raise RagblendError("the retrieval chain needs an 'input' (or 'question') key")
