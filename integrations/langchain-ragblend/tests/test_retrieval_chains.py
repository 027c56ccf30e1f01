"""Classic retrieval chains, streaming/async LCEL, and retriever callbacks feeding each query's
retrieved set (Chroma in a temporary directory, the embedded model)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from conftest import QUESTION, TEXTS
from langchain_classic.chains import create_retrieval_chain
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_core.callbacks import CallbackManagerForRetrieverRun
from langchain_core.documents import Document
from langchain_core.messages import AIMessageChunk
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.retrievers import BaseRetriever
from langchain_core.runnables import RunnableConfig, RunnableLambda, RunnablePassthrough

from langchain_ragblend import (
    BlendStatsCallbackHandler,
    ChatRagBlend,
    add_documents,
    offline_chroma,
)
from langchain_ragblend.retrieved import RECORDER

pytestmark = pytest.mark.slow

TOP_K = len(TEXTS)
CONTEXT_PROMPTS = {
    "system": ChatPromptTemplate.from_messages(
        [("system", "Answer from this context:\n\n{context}"), ("human", "{input}")]
    ),
    "human": ChatPromptTemplate.from_messages(
        [("human", "Answer from this context:\n\n{context}\n\nQuestion: {input}")]
    ),
}
LCEL_PROMPT = ChatPromptTemplate.from_template(
    "Answer the question from the context.\nContext: {context}\nQuestion: {question}\nAnswer:"
)


class ListRetriever(BaseRetriever):
    """Returns fixed documents (a real BaseRetriever: it fires the retriever callbacks)."""

    documents: list[Document]

    def _get_relevant_documents(
        self, query: str, *, run_manager: CallbackManagerForRetrieverRun
    ) -> list[Document]:
        return list(self.documents)


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


@pytest.fixture(scope="module")
def llm(canonical_engine):
    llm = ChatRagBlend(engine=canonical_engine, max_new_tokens=6)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def retriever(tmp_path_factory, llm):
    store = offline_chroma(tmp_path_factory.mktemp("chroma"), collection_name="classic")
    add_documents(store, [Document(page_content=t) for t in TEXTS], llm)  # ingestion warmup
    llm.wait_for_warmup()
    return store.as_retriever(search_kwargs={"k": TOP_K})


def _lcel(llm, retriever):
    context = retriever | format_docs
    return {"context": context, "question": RunnablePassthrough()} | LCEL_PROMPT | llm


def _assert_all_hit(meta: dict, chunks: int = TOP_K) -> None:
    assert meta["mode"] == "blend" and meta["fallback_reason"] is None, meta
    assert (meta["chunk_hits"], meta["chunk_misses"]) == (chunks, 0)


@pytest.mark.parametrize("where", ["system", "human"])
def test_classic_stuff_and_retrieval_chain_hits_every_retrieved_chunk(llm, retriever, where):
    stuff = create_stuff_documents_chain(llm, CONTEXT_PROMPTS[where])
    chain = create_retrieval_chain(retriever, stuff)
    stats = BlendStatsCallbackHandler()
    result = chain.invoke({"input": QUESTION}, config={"callbacks": [stats]})
    assert result["answer"] and len(result["context"]) == TOP_K
    _assert_all_hit(stats.last)


def test_lcel_chain_streams_with_blend(llm, retriever):
    chunks = list(_lcel(llm, retriever).stream(QUESTION))
    assert all(isinstance(c, AIMessageChunk) for c in chunks) and len(chunks) > 1
    message = sum(chunks[1:], chunks[0])
    assert message.content == _lcel(llm, retriever).invoke(QUESTION).content
    _assert_all_hit(message.response_metadata)


def test_lcel_chain_ainvoke_and_astream_blend(llm, retriever):
    chain = _lcel(llm, retriever)

    async def run():
        message = await chain.ainvoke(QUESTION)
        chunks = [c async for c in chain.astream(QUESTION)]
        return message, sum(chunks[1:], chunks[0])

    message, streamed = asyncio.run(run())
    assert streamed.content == message.content
    _assert_all_hit(message.response_metadata)
    _assert_all_hit(streamed.response_metadata)


def test_retrieved_documents_are_matched_without_warmup(canonical_engine):
    # never warmed: only the retriever callback makes these texts known to the query
    docs = [
        Document(page_content=f"Unwarmed passage {i}: the lighthouse keeper counted {i} ships.")
        for i in range(3)
    ]
    llm = ChatRagBlend(engine=canonical_engine, max_new_tokens=3)
    meta = _lcel(llm, ListRetriever(documents=docs)).invoke("How many ships?").response_metadata
    assert meta["chunk_hits"] + meta["chunk_misses"] == len(docs)
    llm.wait_for_warmup()  # the misses were queued at retrieval priority
    meta = _lcel(llm, ListRetriever(documents=docs)).invoke("How many ships?").response_metadata
    _assert_all_hit(meta, chunks=len(docs))
    llm.close()


def _seen_chain(docs: list[Document], barrier: threading.Barrier | None):
    """retriever → (root run, retrieved set) the query sees at its next step (after
    ``barrier``: every query has retrieved before any looks)."""

    def seen(_docs, config: RunnableConfig) -> tuple:
        if barrier is not None:
            barrier.wait(timeout=30)
        run_id = config["callbacks"].parent_run_id
        return RECORDER._root(run_id), RECORDER.retrieved_for(run_id)

    return ListRetriever(documents=docs) | RunnableLambda(seen)


SETS = [
    [
        Document(page_content=f"Query {q} document {i} about the harbour of town {q}.")
        for i in (1, 2)
    ]
    for q in "AB"
]


def _texts(docs: list[Document]) -> tuple[str, ...]:
    return tuple(d.page_content for d in docs)


def test_concurrent_threads_do_not_see_each_others_retrieved_sets():
    barrier = threading.Barrier(2)
    seen: dict[int, tuple] = {}

    def query(i: int) -> None:
        seen[i] = _seen_chain(SETS[i], barrier).invoke("harbour?")

    threads = [threading.Thread(target=query, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [seen[i][1] for i in range(2)] == [_texts(s) for s in SETS]


def test_concurrent_tasks_do_not_see_each_others_retrieved_sets():
    barrier = threading.Barrier(2)  # sync steps of ainvoke run on executor threads

    async def run():
        return await asyncio.gather(*(_seen_chain(s, barrier).ainvoke("harbour?") for s in SETS))

    seen = asyncio.run(run())
    assert [texts for _root, texts in seen] == [_texts(s) for s in SETS]


def test_a_finished_query_forgets_its_retrieved_set():
    root, texts = _seen_chain(SETS[0], None).invoke("harbour?")
    assert texts == _texts(SETS[0])
    with RECORDER._lock:
        assert root not in RECORDER._texts and root not in RECORDER._parents
