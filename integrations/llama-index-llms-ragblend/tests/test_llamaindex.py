"""LlamaIndex integration: a real VectorStoreIndex on Chroma, MiniLM embeddings, embedded model."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("llama_index.llms.ragblend")
pytest.importorskip("llama_index.vector_stores.chroma")

from llama_index.core import Document, StorageContext, VectorStoreIndex  # noqa: E402
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler  # noqa: E402
from llama_index.core.llms import ChatMessage, MessageRole  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.response_synthesizers import get_response_synthesizer  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode  # noqa: E402
from ragblend import RagblendError  # noqa: E402
from ragblend.prompt import split_chat_template  # noqa: E402

from llama_index.llms.ragblend import (  # noqa: E402
    BlendLLM,
    BlendSynthesizer,
    BlendWarmup,
    MiniLMEmbedding,
)
from llama_index.llms.ragblend.query_engine import (  # noqa: E402
    WarmingRetriever,
    blend_query_engine,
    blend_synthesizer,
)

MAX_NEW = 6
TOP_K = 3
QUESTION = "Where was the author of Hannibal and Scipio educated?"
DOCS = [
    (
        "Hannibal and Scipio",
        "Hannibal and Scipio is a Caroline era stage play written by Thomas Nabbes in 1635.",
    ),
    (
        "Thomas Nabbes",
        "Thomas Nabbes was an English dramatist. He was educated at Exeter College, Oxford.",
    ),
    ("Punica", "The Punica is a Latin epic poem in seventeen books written by Silius Italicus."),
    (
        "Exeter College",
        "Exeter College is a constituent college of the University of Oxford, founded in 1314.",
    ),
    (
        "Caroline era",
        "The Caroline era is the period of English history during the reign of "
        "Charles I, from 1625 to 1642.",
    ),
]
COLD_DOCS = [
    ("Lake Baikal", "Lake Baikal is a rift lake in Siberia and the deepest lake in the world."),
    ("Irkutsk", "Irkutsk is a city in Siberia near the southern tip of Lake Baikal."),
]


def _documents(pairs: list[tuple[str, str]]) -> list[Document]:
    return [Document(text=text, metadata={"title": title}) for title, text in pairs]


def _chroma_index(path, name: str, docs, embed, transformations) -> VectorStoreIndex:
    import chromadb
    from chromadb.config import Settings as ChromaSettings
    from llama_index.vector_stores.chroma import ChromaVectorStore

    client = chromadb.PersistentClient(
        path=str(path), settings=ChromaSettings(anonymized_telemetry=False)
    )
    # embedding_function=None: Chroma's default (downloading) embedder never runs
    collection = client.get_or_create_collection(name, embedding_function=None)
    storage = StorageContext.from_defaults(vector_store=ChromaVectorStore(collection))
    return VectorStoreIndex.from_documents(
        _documents(docs),
        storage_context=storage,
        embed_model=embed,
        transformations=transformations,
    )


@pytest.fixture(scope="module")
def embed() -> MiniLMEmbedding:
    return MiniLMEmbedding()


@pytest.fixture(scope="module")
def llm(embedded_engine):
    llm = BlendLLM(engine=embedded_engine, max_new_tokens=MAX_NEW)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def index(tmp_path_factory, embed, llm) -> VectorStoreIndex:
    """Chroma-backed index whose nodes were precomputed by the ingestion transform."""
    splitter = SentenceSplitter(chunk_size=1024)
    index = _chroma_index(
        tmp_path_factory.mktemp("chroma"),
        "ragblend-docs",
        DOCS,
        embed,
        [splitter, embed, BlendWarmup(llm)],
    )
    assert llm.wait_for_warmup(timeout=300)
    return index


def _retrieved_texts(index: VectorStoreIndex, question: str = QUESTION) -> list[str]:
    nodes = index.as_retriever(similarity_top_k=TOP_K).retrieve(question)
    return [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in nodes]


def test_blend_llm_reports_metadata_of_the_engine(llm, embedded_engine):
    meta = llm.metadata
    assert meta.is_chat_model is True
    assert meta.context_window == embedded_engine.context_window
    assert meta.num_output == MAX_NEW
    assert meta.model_name == embedded_engine.name


def test_plain_complete_and_chat_sync_and_async_run_full_prefill_with_usage(llm):
    completion = llm.complete("Name a colour.")
    assert completion.text
    usage = completion.raw["usage"]
    assert usage["completion_tokens"] == llm.last_stats.completion_tokens > 0
    assert llm.last_stats.mode == "full"

    messages = [ChatMessage(role=MessageRole.USER, content="Name a colour.")]
    chat = llm.chat(messages)
    assert chat.message.content == completion.text  # same chat-templated prompt, greedy
    streamed = "".join(r.delta or "" for r in llm.stream_chat(messages))
    assert streamed == chat.message.content

    async def run_async() -> tuple[str, str]:
        reply = await llm.achat(messages)
        deltas = [r.delta or "" async for r in await llm.astream_chat(messages)]
        return reply.message.content, "".join(deltas)

    assert asyncio.run(run_async()) == (chat.message.content, chat.message.content)


def test_synthesizer_hands_engine_retrieved_texts_as_separate_chunks_in_order(
    index, llm, monkeypatch
):
    calls: list[tuple[str, list[str]]] = []
    engine = llm.engine
    original = engine.stream

    def spy(question, chunks, **kwargs):
        calls.append((question, list(chunks)))
        return original(question, chunks, **kwargs)

    monkeypatch.setattr(engine, "stream", spy)
    response = blend_query_engine(llm, index, similarity_top_k=TOP_K).query(QUESTION)

    expected = [n.node.get_content(metadata_mode=MetadataMode.LLM) for n in response.source_nodes]
    assert len(calls) == 1
    assert calls[0] == (QUESTION, expected)
    assert expected == _retrieved_texts(index)
    assert len(expected) == TOP_K and all(text.startswith("title: ") for text in expected)


def test_prompt_text_is_llamaindex_stuff_mode_prompt(index, llm, monkeypatch):
    """The fused prompt renders to the very text simple_summarize sends to a chat model."""
    texts = _retrieved_texts(index)
    captured: list[list[dict]] = []
    engine = llm.engine
    original = engine.chat_ids

    def spy(messages):
        captured.append(messages)
        return original(messages)

    monkeypatch.setattr(engine, "chat_ids", spy)
    full = BlendLLM(engine=engine, mode="full", max_new_tokens=MAX_NEW)  # the stock chat text
    stock = get_response_synthesizer(llm=full, response_mode="simple_summarize")
    stock.get_response(QUESTION, texts)
    assert len(captured) == 1
    stuff_text = engine.tokenizer.apply_chat_template(
        captured[0], tokenize=False, add_generation_prompt=True
    )

    # llama-index-core 0.14 formats the truncated *list* into context_str (its repr, brackets
    # and escapes; run-llama/llama_index PR #22392); the intended context is the joined text.
    joined = "\n".join(texts)
    stuff_text = stuff_text.replace(str([joined]), joined)

    fmt = blend_synthesizer(llm).prompt_format
    head, tail = split_chat_template(engine.tokenizer, fmt.system)
    assert head + fmt.user_text(texts, QUESTION) + tail == stuff_text


def test_ingested_nodes_are_cache_hits_after_warmup(index, llm):
    assert all(llm.is_cached(text) for text in _retrieved_texts(index))
    blend_query_engine(llm, index, similarity_top_k=TOP_K).query(QUESTION)
    stats = llm.last_stats
    assert stats.mode == "blend"
    assert stats.chunk_misses == 0
    assert stats.chunk_hits == TOP_K


def test_blend_at_ratio_one_equals_full_prefill_through_same_query_engine(embedded_engine, index):
    llm = BlendLLM(engine=embedded_engine, mode="blend", ratio=1.0, max_new_tokens=MAX_NEW)
    query_engine = blend_query_engine(llm, index, similarity_top_k=TOP_K, warm_on_retrieval=False)
    blended = str(query_engine.query(QUESTION))
    assert llm.last_stats.mode == "blend" and llm.last_stats.recomputed_fraction == 1.0
    llm.mode = "full"
    full = str(query_engine.query(QUESTION))
    assert llm.last_stats.mode == "full"
    assert blended == full


def test_streaming_query_yields_the_non_streaming_text(index, llm):
    expected = str(blend_query_engine(llm, index, similarity_top_k=TOP_K).query(QUESTION))
    streaming = blend_query_engine(llm, index, similarity_top_k=TOP_K, streaming=True)
    response = streaming.query(QUESTION)
    deltas = list(response.response_gen)
    assert len(deltas) > 1
    assert "".join(deltas) == expected
    assert [n.node.node_id for n in response.source_nodes]


def test_async_query_and_async_stream_match_sync_without_blocking_the_loop(index, llm):
    expected = str(blend_query_engine(llm, index, similarity_top_k=TOP_K).query(QUESTION))

    async def run() -> tuple[str, str, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        start = ticks
        response = await blend_query_engine(llm, index, similarity_top_k=TOP_K).aquery(QUESTION)
        during = ticks - start
        streaming = blend_query_engine(llm, index, similarity_top_k=TOP_K, streaming=True)
        stream = await streaming.aquery(QUESTION)
        text = "".join([delta async for delta in stream.async_response_gen()])
        task.cancel()
        return str(response), text, during

    answer, streamed, ticks = asyncio.run(run())
    assert answer == expected
    assert streamed == expected
    assert ticks >= 2  # the event loop kept running while the engine worked


def test_warming_retriever_enqueues_missed_nodes_and_plain_retrievals_do_not(
    tmp_path, embed, embedded_engine
):
    llm = BlendLLM(engine=embedded_engine, max_new_tokens=MAX_NEW)
    try:
        index = _chroma_index(
            tmp_path, "ragblend-cold", COLD_DOCS, embed, [SentenceSplitter(chunk_size=1024), embed]
        )
        retriever = index.as_retriever(similarity_top_k=2)
        texts = [
            n.node.get_content(metadata_mode=MetadataMode.LLM)
            for n in retriever.retrieve("Which lake is in Siberia?")
        ]
        assert llm.warmup_queue.pending() == 0  # a retrieval outside BlendLLM engines: no warmup
        assert not any(llm.is_cached(t) for t in texts)

        WarmingRetriever(retriever, llm).retrieve("Which lake is in Siberia?")
        assert llm.wait_for_warmup(timeout=300)
        assert llm.warmup_queue.stored == len(texts) == 2
        assert all(llm.is_cached(t) for t in texts)

        WarmingRetriever(retriever, llm).retrieve("Which lake is in Siberia?")
        assert llm.wait_for_warmup(timeout=300)
        assert llm.warmup_queue.stored == 2  # all stored now: nothing new
    finally:
        llm.close()


def test_warmup_transform_returns_nodes_without_waiting_for_precompute(
    embedded_engine, monkeypatch
):
    release = threading.Event()
    original = embedded_engine.precompute_ids

    def gated(ids, head, between_layers=None):
        release.wait(timeout=60)
        return original(ids, head, between_layers)

    monkeypatch.setattr(embedded_engine, "precompute_ids", gated)
    llm = BlendLLM(engine=embedded_engine, max_new_tokens=MAX_NEW)
    nodes = [TextNode(text=f"Gated warmup node number {i}.") for i in range(3)]
    try:
        out = BlendWarmup(llm)(nodes)
        assert out is nodes
        assert llm.warmup_queue.pending() == 3  # queued, not computed: ingestion went on
        assert not llm.wait_for_warmup(timeout=0.05)
    finally:
        release.set()
        assert llm.wait_for_warmup(timeout=300)
        llm.close()
    assert all(llm.is_cached(n.get_content(metadata_mode=MetadataMode.LLM)) for n in nodes)


def test_chunks_longer_than_context_window_raise_clear_error(llm):
    long_text = "The quick brown fox jumps over the lazy dog. " * 400
    nodes = [NodeWithScore(node=TextNode(text=f"{i} {long_text}"), score=1.0) for i in range(3)]
    synthesizer = BlendSynthesizer(llm=llm)
    with pytest.raises(RagblendError, match="context window"):
        synthesizer.synthesize(QUESTION, nodes)


def test_token_counting_handler_counts_engine_usage(index, embedded_engine):
    counter = TokenCountingHandler()  # its own tokenizer differs: counts must come from usage
    llm = BlendLLM(engine=embedded_engine, max_new_tokens=MAX_NEW)
    manager = CallbackManager([counter])
    query_engine = blend_query_engine(
        llm, index, similarity_top_k=TOP_K, callback_manager=manager, warm_on_retrieval=False
    )
    query_engine.query(QUESTION)
    first = llm.last_stats
    assert len(counter.llm_token_counts) == 1
    assert counter.prompt_llm_token_count == first.prompt_tokens > 0
    assert counter.completion_llm_token_count == first.completion_tokens > 0

    streaming = blend_query_engine(
        llm,
        index,
        similarity_top_k=TOP_K,
        streaming=True,
        callback_manager=manager,
        warm_on_retrieval=False,
    )
    "".join(streaming.query(QUESTION).response_gen)
    assert len(counter.llm_token_counts) == 2
    assert counter.total_llm_token_count == 2 * (first.prompt_tokens + first.completion_tokens)
