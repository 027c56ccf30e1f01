"""Index-time and retrieval-time KV precompute for BlendLLM (never blocks the caller)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any
from uuid import uuid4

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from llama_index.core.instrumentation.events import BaseEvent
from llama_index.core.instrumentation.events.retrieval import RetrievalEndEvent
from llama_index.core.schema import BaseNode, TransformComponent

from llama_index.llms.ragblend.base import BaseBlendLLM

log = logging.getLogger(__name__)
_CACHED_MODES = ("reuse", "blend")  # the modes that read chunk caches


class BlendWarmup(TransformComponent):
    """Ingestion transform: enqueue each node's LLM-mode text for background KV precompute.

    Append it after the splitter (and embedding), e.g.
    ``VectorStoreIndex.from_documents(docs, transformations=[splitter, embed, BlendWarmup(llm)])``
    or an ``IngestionPipeline``. Nodes pass through unchanged; call ``llm.wait_for_warmup()``
    when the caches must be ready.
    """

    instance_id: str = Field(
        default_factory=lambda: uuid4().hex,
        description="Per-instance id: an IngestionCache hit must not skip the warmup of a "
        "new KV store.",
    )
    escaped_forms: bool = Field(
        default=False,
        description="Also precompute each node in the escaped form response_mode="
        "'simple_summarize' sends (its context is a Python list); doubles the warmup work.",
    )
    _llm: BaseBlendLLM = PrivateAttr()

    def __init__(self, llm: BaseBlendLLM, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._llm = llm

    @classmethod
    def class_name(cls) -> str:
        return "BlendWarmup"

    @property
    def llm(self) -> BaseBlendLLM:
        return self._llm

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        self._llm.warmup_nodes(nodes, escaped_forms=self.escaped_forms)
        return nodes


class BlendRetrievalHook(BaseEventHandler):
    """Instrumentation handler: on ``RetrievalEndEvent`` enqueue retrieved nodes not yet stored.

    Process-wide opt-in (``BlendRetrievalHook(llm).attach()``): it sees every retrieval on the
    dispatcher. To warm only the retrievals of query engines that use this LLM, use
    :func:`~llama_index.llms.ragblend.query_engine.blend_query_engine` (a
    :class:`~llama_index.llms.ragblend.query_engine.WarmingRetriever`) instead.
    """

    enqueued: int = 0
    _llm: BaseBlendLLM = PrivateAttr()
    _dispatcher: Any = PrivateAttr(default=None)

    def __init__(self, llm: BaseBlendLLM, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._llm = llm

    @classmethod
    def class_name(cls) -> str:
        return "BlendRetrievalHook"

    def handle(self, event: BaseEvent, **kwargs: Any) -> None:
        if not isinstance(event, RetrievalEndEvent) or self._llm.mode not in _CACHED_MODES:
            return
        try:
            self.enqueued += self._llm.warmup_nodes(event.nodes, only_missing=True)
        except Exception as exc:  # a warmup problem must never break retrieval
            log.warning("ragblend retrieval warmup failed: %s", exc)

    def attach(self, dispatcher: Any = None) -> None:
        """Register on ``dispatcher`` (default: LlamaIndex's root dispatcher)."""
        self._dispatcher = dispatcher or get_dispatcher()
        self._dispatcher.add_event_handler(self)

    def detach(self) -> None:
        if self._dispatcher is not None:
            handlers = self._dispatcher.event_handlers
            self._dispatcher.event_handlers = [h for h in handlers if h is not self]
            self._dispatcher = None
