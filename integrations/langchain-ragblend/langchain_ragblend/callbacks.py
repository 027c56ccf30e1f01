"""Callbacks and ingestion helpers that keep chunk KV caches warm."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.outputs import LLMResult
from langchain_core.vectorstores import VectorStore

from langchain_ragblend.chat_models import ChatRagBlend
from langchain_ragblend.chunks import document_text


class KVWarmupCallbackHandler(BaseCallbackHandler):
    """On each retriever result, enqueue the documents whose KV is not stored yet.

    Attach with ``config={"callbacks": [handler]}`` or ``chain.with_config(callbacks=[...])``;
    precompute runs on ``llm``'s background warmup queue, so later queries retrieving the
    same documents hit the KV store. ``enqueued`` lists every chunk text it enqueued.
    """

    def __init__(self, llm: ChatRagBlend) -> None:
        self.llm = llm
        self.enqueued: list[str] = []
        self._lock = threading.Lock()

    def on_retriever_end(
        self,
        documents: Sequence[Document],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        **kwargs: Any,
    ) -> None:
        texts = self.llm.warm_retrieved(documents)
        with self._lock:
            self.enqueued.extend(texts)


class BlendStatsCallbackHandler(BaseCallbackHandler):
    """Collects each ChatRagBlend call's response metadata and usage (TTFT, hits, mode…)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def on_llm_end(self, response: LLMResult, **kwargs: Any) -> None:
        for generations in response.generations:
            for generation in generations:
                message = getattr(generation, "message", None)
                if message is None:
                    continue
                record = dict(message.response_metadata)
                record["usage"] = dict(getattr(message, "usage_metadata", None) or {})
                with self._lock:
                    self.records.append(record)

    @property
    def last(self) -> dict[str, Any]:
        """The latest call's record."""
        with self._lock:
            return self.records[-1]


def warm_documents(
    documents: Sequence[Document | str], llm: ChatRagBlend, wait: bool = False
) -> list[str]:
    """Enqueue background KV precompute of the documents not stored yet (``wait``: block)."""
    enqueued = llm.warm(documents)
    if wait:
        llm.wait_for_warmup()
    return enqueued


def add_documents(
    vectorstore: VectorStore,
    documents: Sequence[Document],
    llm: ChatRagBlend,
    **kwargs: Any,
) -> list[str]:
    """``vectorstore.add_documents(documents)`` that also enqueues their KV precompute.

    With ``precompute_context="neighbours"`` the documents' embeddings (the store's own) make
    them known to the engine as neighbours first."""
    ids = vectorstore.add_documents(list(documents), **kwargs)
    if llm.engine.config.precompute_context == "neighbours":
        add_embeddings(vectorstore, ids, documents, llm)
    llm.warm(documents)
    return ids


def add_embeddings(
    vectorstore: VectorStore, ids: Sequence[str], documents: Sequence[Document], llm: ChatRagBlend
) -> None:
    """Give ``llm``'s engine the documents' embeddings, under each layout's document text: the
    vectors the store keeps (Chroma's ``get``), else its embedding function's."""
    vectors: list | None = None
    get = getattr(vectorstore, "get", None)
    if callable(get) and ids:
        try:
            got = get(ids=list(ids), include=["embeddings"])
            by_id = dict(zip(got["ids"], got["embeddings"], strict=True))
            vectors = [list(by_id[i]) for i in ids]
        except Exception:  # another store's get: embed again below
            vectors = None
    if vectors is None:
        embedding = vectorstore.embeddings
        if embedding is None:
            return  # nothing to compare documents by: they are precomputed alone
        vectors = embedding.embed_documents([d.page_content for d in documents])
    for layout in llm.layouts:
        texts = [document_text(doc, layout.document_prompt) for doc in documents]
        llm.engine.add_embeddings(texts, vectors)
