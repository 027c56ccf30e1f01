"""Query-engine factory: a BlendLLM query engine whose retrievals warm this LLM's KV pool.

Kept apart from :mod:`.base` so that the LLM, the synthesizer and the warmup hooks import in
one direction only (base ← synthesizer ← query_engine; base ← warmup).
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.indices.base import BaseIndex
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index.llms.ragblend.base import BaseBlendLLM
from llama_index.llms.ragblend.synthesizer import BlendSynthesizer


class WarmingRetriever(BaseRetriever):
    """Delegates to ``retriever``; the nodes it returns that miss the store are queued for
    precompute ahead of the ingestion backlog. Scoped by construction: only the query engines
    built with it warm, not every retrieval in the process."""

    def __init__(self, retriever: BaseRetriever, llm: BaseBlendLLM) -> None:
        super().__init__(callback_manager=retriever.callback_manager)
        self._retriever = retriever
        self._llm = llm

    def _warm(self, nodes: list[NodeWithScore]) -> list[NodeWithScore]:
        if self._llm.mode in ("reuse", "blend"):
            self._llm.warmup_nodes(nodes, only_missing=True)
        return nodes

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return self._warm(self._retriever.retrieve(query_bundle))

    async def _aretrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return self._warm(await self._retriever.aretrieve(query_bundle))


def blend_synthesizer(
    llm: BaseBlendLLM,
    streaming: bool = False,
    text_qa_template: BasePromptTemplate | None = None,
    **kwargs: Any,
) -> BlendSynthesizer:
    """A stuff-mode synthesizer that hands each retrieved node to the engine as a chunk."""
    return BlendSynthesizer(
        llm=llm, streaming=streaming, text_qa_template=text_qa_template, **kwargs
    )


def blend_query_engine(
    llm: BaseBlendLLM,
    index: BaseIndex,
    *,
    streaming: bool = False,
    text_qa_template: BasePromptTemplate | None = None,
    warm_on_retrieval: bool = True,
    **kwargs: Any,
) -> RetrieverQueryEngine:
    """``index.as_query_engine`` with ``llm`` and the chunk-preserving synthesizer.

    ``warm_on_retrieval`` wraps the retriever in a :class:`WarmingRetriever`. Other keyword
    arguments go to ``index.as_query_engine`` (e.g. ``similarity_top_k``); a
    ``callback_manager`` is also given to the synthesizer.
    """
    # the index's retriever rejects a second callback manager, and index.as_query_engine
    # gives the LLM the index's one: install ours on the synthesizer (and engine) afterwards
    manager = kwargs.pop("callback_manager", None)
    synth = blend_synthesizer(llm, streaming=streaming, text_qa_template=text_qa_template)
    query_engine = index.as_query_engine(llm=llm, response_synthesizer=synth, **kwargs)
    if warm_on_retrieval:
        query_engine = RetrieverQueryEngine(
            retriever=WarmingRetriever(query_engine.retriever, llm),
            response_synthesizer=synth,
            node_postprocessors=query_engine._node_postprocessors,
            callback_manager=query_engine.callback_manager,
        )
    if manager is not None:
        synth.callback_manager = manager
        query_engine.callback_manager = manager
    return query_engine
