"""How retrieved documents travel to the model as separate chunks: tagged text content blocks.

A human message carries its documents as standard v1 text blocks, one per document, tagged in
the block's ``extras``::

    HumanMessage(content=[
        {"type": "text", "text": "Context:\\n"},                                   # prefix
        {"type": "text", "text": "doc 1", "extras": {"ragblend_chunk": True}},
        {"type": "text", "text": "\\n\\n"},                                        # separator
        {"type": "text", "text": "doc 2", "extras": {"ragblend_chunk": True}},
        {"type": "text", "text": "\\n\\nQuestion: ..."},                            # suffix
    ])

Concatenating every block's text gives exactly the message a plain chat model would see, so
other chat models read it as ordinary text. :class:`~langchain_ragblend.ChatRagBlend` uses the
tags to keep chunk boundaries (never parsing a joined string) and reuse each chunk's KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import HumanMessage
from langchain_core.prompts import BasePromptTemplate, PromptTemplate, format_document
from ragblend import RagblendError

CHUNK_TAG = "ragblend_chunk"
DEFAULT_DOCUMENT_PROMPT = PromptTemplate.from_template("{page_content}")
DEFAULT_DOCUMENT_SEPARATOR = "\n\n"


def document_text(doc: Document | str, document_prompt: BasePromptTemplate | None = None) -> str:
    """The text a document contributes to the prompt (``{page_content}`` by default)."""
    if isinstance(doc, str):
        return doc
    return format_document(doc, document_prompt or DEFAULT_DOCUMENT_PROMPT)


def chunk_block(
    chunk: Document | str, document_prompt: BasePromptTemplate | None = None
) -> dict[str, Any]:
    """A text content block tagged as one retrieved chunk."""
    extras: dict[str, Any] = {CHUNK_TAG: True}
    if isinstance(chunk, Document) and chunk.id is not None:
        extras["document_id"] = chunk.id
    return {"type": "text", "text": document_text(chunk, document_prompt), "extras": extras}


def is_chunk_block(block: Any) -> bool:
    """Whether a content block is a tagged chunk."""
    return (
        isinstance(block, dict)
        and block.get("type") == "text"
        and bool((block.get("extras") or {}).get(CHUNK_TAG))
    )


def chunk_blocks(
    documents: Sequence[Document | str],
    prefix: str = "",
    suffix: str = "",
    separator: str = DEFAULT_DOCUMENT_SEPARATOR,
    document_prompt: BasePromptTemplate | None = None,
) -> list[dict[str, Any]]:
    """Content blocks ``prefix, chunk 1, separator, chunk 2, …, suffix`` (empty text omitted)."""
    blocks: list[dict[str, Any]] = []
    if prefix:
        blocks.append({"type": "text", "text": prefix})
    for i, doc in enumerate(documents):
        if i and separator:
            blocks.append({"type": "text", "text": separator})
        blocks.append(chunk_block(doc, document_prompt))
    if suffix:
        blocks.append({"type": "text", "text": suffix})
    return blocks


def documents_message(
    documents: Sequence[Document | str],
    prefix: str = "",
    suffix: str = "",
    separator: str = DEFAULT_DOCUMENT_SEPARATOR,
    document_prompt: BasePromptTemplate | None = None,
) -> HumanMessage:
    """A human message holding each document as its own chunk block."""
    return HumanMessage(content=chunk_blocks(documents, prefix, suffix, separator, document_prompt))


@dataclass(frozen=True)
class ChunkedContent:
    """A user message split at its chunks: ``prefix + sep.join(chunks) + suffix``."""

    prefix: str
    chunks: list[str]
    separator: str
    suffix: str

    @property
    def text(self) -> str:
        return self.prefix + self.separator.join(self.chunks) + self.suffix


def block_text(block: Any) -> str:
    """Text of a string or text content block; other block types are rejected."""
    if isinstance(block, str):
        return block
    if isinstance(block, dict) and block.get("type") == "text":
        return str(block.get("text", ""))
    kind = block.get("type") if isinstance(block, dict) else type(block).__name__
    raise RagblendError(f"ChatRagBlend handles text only; got a content block of type {kind!r}")


def content_text(content: str | list) -> str:
    """The plain text of message content (every text block concatenated)."""
    if isinstance(content, str):
        return content
    return "".join(block_text(b) for b in content)


def split_chunked_content(content: str | list) -> ChunkedContent | None:
    """Split message content at its chunk blocks; ``None`` when it holds none.

    Untagged text before the first chunk is the prefix, between chunks the separator (it must
    be the same between every pair) and after the last chunk the suffix.
    """
    if isinstance(content, str) or not any(is_chunk_block(b) for b in content):
        return None
    pieces: list[str] = [""]  # untagged text runs around the chunks
    chunks: list[str] = []
    for block in content:
        if is_chunk_block(block):
            text = block_text(block)
            if not text.strip():
                raise RagblendError(f"chunk {len(chunks)} is empty")
            chunks.append(text)
            pieces.append("")
        else:
            pieces[-1] += block_text(block)
    gaps = pieces[1:-1]
    if len(set(gaps)) > 1:
        raise RagblendError(
            "the text between chunks differs between chunk pairs; use one separator throughout"
        )
    separator = gaps[0] if gaps else DEFAULT_DOCUMENT_SEPARATOR
    return ChunkedContent(prefix=pieces[0], chunks=chunks, separator=separator, suffix=pieces[-1])
