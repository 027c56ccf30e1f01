"""LlamaIndex QA templates as ragblend prompt formats (same text as LlamaIndex's stuff mode)."""

from __future__ import annotations

from llama_index.core.base.llms.types import MessageRole
from llama_index.core.prompts import (
    BasePromptTemplate,
    ChatPromptTemplate,
    PromptTemplate,
    SelectorPromptTemplate,
)
from llama_index.core.prompts.chat_prompts import CHAT_TEXT_QA_PROMPT

from ragblend import PromptFormat, RagblendError

# ``SimpleSummarize`` (LlamaIndex's stuff mode) joins the retrieved texts with one newline.
STUFF_SEPARATOR = "\n"


def qa_prompt_format(
    template: BasePromptTemplate | None = None,
    system_prompt: str | None = None,
    separator: str = STUFF_SEPARATOR,
) -> PromptFormat:
    """The :class:`PromptFormat` that renders ``template`` exactly as LlamaIndex's stuff mode.

    ``template`` defaults to LlamaIndex's chat QA prompt (``CHAT_TEXT_QA_PROMPT``, what
    ``simple_summarize`` uses with a chat model): its system message becomes the format's system
    message, its user message the prefix/suffix around the chunks. A plain ``PromptTemplate``
    gets ``system_prompt`` (the LLM's), or the chat template's own default when that is None.
    """
    template = template if template is not None else CHAT_TEXT_QA_PROMPT
    if isinstance(template, SelectorPromptTemplate):
        template = _chat_choice(template)
    if isinstance(template, ChatPromptTemplate):
        systems, users = [], []
        for message in template.message_templates:
            if message.role == MessageRole.SYSTEM:
                systems.append(message.content or "")
            elif message.role == MessageRole.USER:
                users.append(message.content or "")
            else:
                raise RagblendError(
                    f"QA template has a {message.role.value!r} message; only system and user "
                    "messages can be laid out around retrieved chunks"
                )
        if len(users) != 1:
            raise RagblendError("QA chat template must have exactly one user message")
        system = "\n".join(systems) if systems else system_prompt
        return _from_text(users[0], template.kwargs, system, separator)
    if isinstance(template, PromptTemplate):
        return _from_text(template.template, template.kwargs, system_prompt, separator)
    raise RagblendError(
        f"unsupported QA template type {type(template).__name__}; use a PromptTemplate or "
        "ChatPromptTemplate with {context_str} and {query_str}"
    )


def _chat_choice(template: SelectorPromptTemplate) -> BasePromptTemplate:
    """The template a selector picks for a chat model (BlendLLM is one)."""
    for predicate, choice in template.conditionals or []:
        if getattr(predicate, "__name__", "") == "is_chat_model":
            return choice
    return template.default_template


def _from_text(text: str, partials: dict, system: str | None, separator: str) -> PromptFormat:
    """Apply the template's partial variables, then split it around ``{context_str}``."""
    if partials:
        keep = {"context_str": "{context_str}", "query_str": "{query_str}"}
        try:
            text = text.format(**{**{k: str(v) for k, v in partials.items()}, **keep})
        except KeyError as exc:
            raise RagblendError(f"QA template has an unfilled placeholder {exc}") from None
    return PromptFormat.from_template(
        text,
        context_var="context_str",
        question_var="query_str",
        separator=separator,
        system=system,
    )
