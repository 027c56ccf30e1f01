"""Plain LangChain idioms (LCEL format_docs chain, stuff-chain layout) fuse warmed chunks."""

from __future__ import annotations

import logging

import pytest
from conftest import QUESTION, TEXTS
from langchain_core.documents import Document
from langchain_core.messages import HumanMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableLambda, RunnablePassthrough

from langchain_ragblend import ChatRagBlend

pytestmark = pytest.mark.slow

DOCS = [Document(page_content=t) for t in TEXTS]
# the hub's rag-prompt: the question comes before the context
RAG_PROMPT = ChatPromptTemplate.from_messages(
    [
        (
            "human",
            "You are an assistant for question-answering tasks. Use the following pieces of "
            "retrieved context to answer the question.\nQuestion: {question}\n"
            "Context: {context}\nAnswer:",
        )
    ]
)
# create_stuff_documents_chain's layout: the joined documents in the system message
STUFF_PROMPT = ChatPromptTemplate.from_messages(
    [("system", "Answer from this context:\n\n{context}"), ("human", "{question}")]
)


def format_docs(docs: list[Document]) -> str:
    return "\n\n".join(doc.page_content for doc in docs)


@pytest.fixture(scope="module")
def warmed(canonical_engine):
    llm = ChatRagBlend(engine=canonical_engine, max_new_tokens=6)
    llm.warm(DOCS)
    llm.wait_for_warmup()
    yield llm
    llm.close()


def _chain(llm, prompt):
    retriever = RunnableLambda(lambda question: DOCS)
    context = retriever | format_docs
    return {"context": context, "question": RunnablePassthrough()} | prompt | llm


@pytest.mark.parametrize("prompt", [RAG_PROMPT, STUFF_PROMPT], ids=["human", "system"])
def test_lcel_chain_hits_every_retrieved_chunk(warmed, prompt):
    message = _chain(warmed, prompt).invoke(QUESTION)
    meta = message.response_metadata
    assert meta["mode"] == "blend" and meta["fallback_reason"] is None
    assert (meta["chunk_hits"], meta["chunk_misses"]) == (len(DOCS), 0)


def test_lcel_chain_at_ratio_one_answers_as_full(canonical_engine, warmed):
    answers = {}
    for name, kwargs in {"full": {"mode": "full"}, "blend": {"ratio": 1.0}}.items():
        llm = ChatRagBlend(engine=canonical_engine, max_new_tokens=8, **kwargs)
        answers[name] = (_chain(llm, RAG_PROMPT) | StrOutputParser()).invoke(QUESTION)
    assert answers["blend"] == answers["full"]


def test_stop_sequence_ends_decoding_and_usage_counts_kept_tokens(canonical_engine):
    llm = ChatRagBlend(engine=canonical_engine, max_new_tokens=24, mode="full")
    question = [HumanMessage("Tell me about the city of Paris.")]
    free = llm.invoke(question)
    text = str(free.content)
    stop = " " + text.split()[3]
    kept = text[: text.find(stop)]
    message = llm.invoke(question, stop=[stop])
    assert message.content == kept
    assert message.response_metadata["finish_reason"] == "stop"
    # before the fix decoding went on to max_new_tokens and all of them were counted
    output_tokens = message.usage_metadata["output_tokens"]
    assert output_tokens < free.usage_metadata["output_tokens"]
    assert len(llm.get_token_ids(kept)) <= output_tokens <= len(llm.get_token_ids(kept)) + 1


def test_ls_params_report_a_per_call_model(warmed):
    params = warmed._get_ls_params(model="other-model", max_tokens=7)
    assert params["ls_model_name"] == "other-model" and params["ls_max_tokens"] == 7


def test_chat_without_known_chunk_runs_full_and_warns_once(canonical_engine, caplog):
    llm = ChatRagBlend(engine=canonical_engine, max_new_tokens=3)
    with caplog.at_level(logging.WARNING):
        llm.invoke("Say hello to the reader in a friendly way.")
        message = llm.invoke("Say goodbye to the reader in a friendly way.")
    assert message.response_metadata["mode"] == "full"
    assert message.response_metadata["fallback_reason"] == "no_known_chunk"
    warnings = [r for r in caplog.records if "full prefill" in r.getMessage()]
    assert len(warnings) == 1
