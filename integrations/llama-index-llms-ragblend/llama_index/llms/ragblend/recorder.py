"""Records each query's retrieved node texts for content-addressed chunk matching."""

from __future__ import annotations

import threading
from typing import Any

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.query import QueryStartEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.schema import MetadataMode

from ragblend.matching import add_retrieved, clear_retrieved

_INSTALLED = False
_LOCK = threading.Lock()


class RetrievedTextsRecorder(BaseEventHandler):
    """On ``RetrievalEndEvent`` record the nodes' prompt texts in the current context.

    The texts live in a context variable (:func:`ragblend.matching.add_retrieved`), so
    concurrent queries (threads, asyncio tasks) never see each other's retrieved sets; a
    ``QueryStartEvent`` starts a fresh set.
    """

    @classmethod
    def class_name(cls) -> str:
        return "RagblendRetrievedTextsRecorder"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if isinstance(event, QueryStartEvent):
            clear_retrieved()
        elif isinstance(event, RetrievalEndEvent):
            texts = []
            for node in event.nodes:
                text = node.get_content(metadata_mode=MetadataMode.LLM)
                texts += [text, text.strip(), node.get_content(MetadataMode.NONE).strip()]
            add_retrieved(dict.fromkeys(texts))


def install_retrieval_recorder() -> None:
    """Add the recorder to LlamaIndex's root dispatcher once per process."""
    global _INSTALLED
    with _LOCK:
        if not _INSTALLED:
            get_dispatcher().add_event_handler(RetrievedTextsRecorder())
            _INSTALLED = True
