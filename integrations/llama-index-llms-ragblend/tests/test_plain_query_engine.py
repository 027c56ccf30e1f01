"""Plain LlamaIndex idioms (Settings.llm + index.as_query_engine) fuse warmed chunk caches."""

from __future__ import annotations

import asyncio
import logging

import pytest
from llama_index.core import Document, Settings, StorageContext, VectorStoreIndex
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.prompts import PromptTemplate

from llama_index.llms.ragblend import BlendLLM, BlendWarmup, MiniLMEmbedding

pytestmark = pytest.mark.slow

TOP_K = 3
QUESTION = "Where was the author of Hannibal and Scipio educated?"
TEXTS = [
    "Hannibal and Scipio is a Caroline era stage play written by Thomas Nabbes in 1635.",
    "Thomas Nabbes was an English dramatist. He was educated at Exeter College, Oxford.",
    "The Punica is a Latin epic poem in seventeen books written by Silius Italicus.",
    "Exeter College is a constituent college of the University of Oxford, founded in 1314.",
]


@pytest.fixture(scope="module")
def llm(canonical_engine):
    llm = BlendLLM(engine=canonical_engine, max_new_tokens=6)
    previous = Settings._llm, Settings._embed_model
    Settings.llm = llm
    yield llm
    Settings._llm, Settings._embed_model = previous
    llm.close()


@pytest.fixture(scope="module")
def index(tmp_path_factory, llm):
    import chromadb
    from chromadb.config import Settings as ChromaSettings
    from llama_index.vector_stores.chroma import ChromaVectorStore

    embed = MiniLMEmbedding()
    Settings.embed_model = embed
    client = chromadb.PersistentClient(
        path=str(tmp_path_factory.mktemp("chroma")),
        settings=ChromaSettings(anonymized_telemetry=False),
    )
    collection = client.get_or_create_collection("plain-docs", embedding_function=None)
    storage = StorageContext.from_defaults(vector_store=ChromaVectorStore(collection))
    docs = [Document(text=t, metadata={"title": f"doc {i}"}) for i, t in enumerate(TEXTS)]
    index = VectorStoreIndex.from_documents(
        docs,
        storage_context=storage,
        transformations=[SentenceSplitter(chunk_size=1024), embed, BlendWarmup(llm)],
    )
    assert llm.wait_for_warmup(timeout=300)
    return index


def _assert_all_hit(llm: BlendLLM, chunks: int = TOP_K) -> None:
    stats = llm.last_stats
    assert stats.mode == "blend", stats.extra
    assert (stats.chunk_hits, stats.chunk_misses) == (chunks, 0)


def test_default_compact_query_engine_hits_every_retrieved_chunk(index, llm):
    response = index.as_query_engine(similarity_top_k=TOP_K).query(QUESTION)
    assert str(response)
    _assert_all_hit(llm)


def test_streaming_query_engine_hits_and_streams_the_same_answer(index, llm):
    text = str(index.as_query_engine(similarity_top_k=TOP_K).query(QUESTION))
    response = index.as_query_engine(similarity_top_k=TOP_K, streaming=True).query(QUESTION)
    assert "".join(response.response_gen) == text
    _assert_all_hit(llm)


def test_async_query_engine_hits(index, llm):
    response = asyncio.run(index.as_query_engine(similarity_top_k=TOP_K).aquery(QUESTION))
    assert str(response)
    _assert_all_hit(llm)


def test_async_streaming_query_engine_hits(index, llm):
    async def run() -> str:
        engine = index.as_query_engine(similarity_top_k=TOP_K, streaming=True)
        response = await engine.aquery(QUESTION)
        return "".join([token async for token in response.async_response_gen()])

    assert asyncio.run(run())
    _assert_all_hit(llm)


def test_refine_mode_hits_the_chunk_of_each_llm_call(index, llm):
    index.as_query_engine(similarity_top_k=TOP_K, response_mode="refine").query(QUESTION)
    _assert_all_hit(llm, chunks=1)


def test_simple_summarize_finds_chunks_in_its_list_repr_and_hits_once_they_are_warmed(index, llm):
    # simple_summarize formats its context as a Python list: every chunk's newlines escaped
    engine = index.as_query_engine(similarity_top_k=TOP_K, response_mode="simple_summarize")
    engine.query(QUESTION)
    stats = llm.last_stats
    assert stats.chunk_hits + stats.chunk_misses == TOP_K  # each chunk found in its escaped form
    assert llm.wait_for_warmup(timeout=300)  # the missed forms were queued at retrieval priority
    engine.query(QUESTION)
    _assert_all_hit(llm)


def test_ingestion_warmup_with_escaped_forms_lets_simple_summarize_hit_at_once(canonical_engine):
    llm = BlendLLM(engine=canonical_engine, max_new_tokens=4)
    docs = [
        Document(text=f"{t}\nIt's in volume {i}.", metadata={"title": f"vol {i}"})
        for i, t in enumerate(TEXTS)
    ]
    embed, warmup = MiniLMEmbedding(), BlendWarmup(llm, escaped_forms=True)
    index = VectorStoreIndex.from_documents(
        docs, transformations=[SentenceSplitter(chunk_size=1024), embed, warmup], embed_model=embed
    )
    assert llm.wait_for_warmup(timeout=300)
    engine = index.as_query_engine(
        llm=llm, similarity_top_k=TOP_K, response_mode="simple_summarize"
    )
    engine.query(QUESTION)
    _assert_all_hit(llm)
    llm.close()


def test_blend_at_ratio_one_answers_as_full_prefill_through_plain_query_engine(
    index, canonical_engine
):
    answers = {}
    for name, kwargs in {"full": {"mode": "full"}, "blend": {"ratio": 1.0}}.items():
        llm = BlendLLM(engine=canonical_engine, max_new_tokens=8, **kwargs)
        engine = index.as_query_engine(llm=llm, similarity_top_k=TOP_K)
        answers[name] = str(engine.query(QUESTION))
        if name == "blend":
            _assert_all_hit(llm)
    assert answers["blend"] == answers["full"]


def test_question_first_template_hits_chunks_warmed_under_the_default_template(index, llm):
    template = PromptTemplate(
        "Question: {query_str}\nAnswer using only these passages.\n{context_str}\nAnswer:"
    )
    index.as_query_engine(similarity_top_k=TOP_K, text_qa_template=template).query(QUESTION)
    _assert_all_hit(llm)


def test_prompt_without_known_chunk_runs_full_prefill_and_warns_once(canonical_engine, caplog):
    llm = BlendLLM(engine=canonical_engine, max_new_tokens=3)
    with caplog.at_level(logging.WARNING):
        llm.complete("Say hello to the reader in a friendly way.")
        llm.complete("Say goodbye to the reader in a friendly way.")
    assert llm.last_stats.mode == "full"
    assert llm.last_stats.extra["fallback_reason"] == "no_known_chunk"
    warnings = [r for r in caplog.records if "full prefill" in r.getMessage()]
    assert len(warnings) == 1 and "warm" in warnings[0].getMessage()
