"""Each query's retrieved documents, from LangChain's retriever callbacks, for chunk matching.

A plain chain (``retriever | format_docs``, ``create_retrieval_chain``) hands ChatRagBlend one
joined string. The texts it retrieved are found inside that string (:mod:`ragblend.matching`)
even when they were never warmed: :data:`RECORDER` is added to every LangChain run through a
configure hook (as LangChain adds its tracers), records ``on_retriever_end`` documents under
the run's root, and ChatRagBlend asks for the set of its own root run. Concurrent queries
(threads, asyncio tasks) have different root runs, so they never see each other's sets.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.tracers.context import register_configure_hook


class RetrievedDocumentsRecorder(BaseCallbackHandler):
    """Records the page contents each root run retrieved; forgets them when the root ends."""

    run_inline = True  # recorded before the next step of the chain starts

    def __init__(self) -> None:
        self._parents: dict[UUID, UUID | None] = {}
        self._texts: dict[UUID, list[str]] = {}
        self._lock = threading.Lock()

    def retrieved_for(self, run_id: UUID) -> tuple[str, ...]:
        """Texts retrieved so far under ``run_id``'s root run."""
        with self._lock:
            return tuple(self._texts.get(self._root(run_id), ()))

    def _root(self, run_id: UUID) -> UUID:
        parent = self._parents.get(run_id)
        while parent is not None:
            run_id, parent = parent, self._parents.get(parent)
        return run_id

    def _start(self, run_id: UUID, parent_run_id: UUID | None) -> None:
        with self._lock:
            self._parents[run_id] = parent_run_id

    def _end(self, run_id: UUID) -> None:
        with self._lock:
            if self._parents.pop(run_id, None) is None:  # a root run: its query is over
                self._texts.pop(run_id, None)

    # ------------------------------------------------------------------ starts
    def on_chain_start(self, serialized, inputs, *, run_id, parent_run_id=None, **kw) -> None:
        self._start(run_id, parent_run_id)

    def on_retriever_start(self, serialized, query, *, run_id, parent_run_id=None, **kw) -> None:
        self._start(run_id, parent_run_id)

    def on_chat_model_start(
        self, serialized, messages, *, run_id, parent_run_id=None, **kw
    ) -> None:
        self._start(run_id, parent_run_id)

    def on_llm_start(self, serialized, prompts, *, run_id, parent_run_id=None, **kw) -> None:
        self._start(run_id, parent_run_id)

    def on_tool_start(self, serialized, input_str, *, run_id, parent_run_id=None, **kw) -> None:
        self._start(run_id, parent_run_id)

    # ------------------------------------------------------------------ ends
    def on_retriever_end(self, documents: Sequence[Document], *, run_id: UUID, **kw: Any) -> None:
        texts = [d.page_content for d in documents if isinstance(d, Document)]
        texts += [t.strip() for t in texts]
        with self._lock:
            bucket = self._texts.setdefault(self._root(run_id), [])
            bucket.extend(t for t in dict.fromkeys(texts) if t and t not in bucket)
        self._end(run_id)

    def on_retriever_error(self, error, *, run_id, **kw) -> None:
        self._end(run_id)

    def on_chain_end(self, outputs, *, run_id, **kw) -> None:
        self._end(run_id)

    def on_chain_error(self, error, *, run_id, **kw) -> None:
        self._end(run_id)

    def on_llm_end(self, response, *, run_id, **kw) -> None:
        self._end(run_id)

    def on_llm_error(self, error, *, run_id, **kw) -> None:
        self._end(run_id)

    def on_tool_end(self, output, *, run_id, **kw) -> None:
        self._end(run_id)

    def on_tool_error(self, error, *, run_id, **kw) -> None:
        self._end(run_id)


RECORDER = RetrievedDocumentsRecorder()
_RECORDER_VAR: ContextVar[RetrievedDocumentsRecorder | None] = ContextVar(
    "ragblend_retrieved_recorder", default=RECORDER
)
register_configure_hook(_RECORDER_VAR, inheritable=True)
