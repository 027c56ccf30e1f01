"""Deprecated BlendLLM methods keep working, warn, and name their replacement."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("llama_index.llms.ragblend")

from llama_index.core import Document, VectorStoreIndex  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.query_engine import RetrieverQueryEngine  # noqa: E402

from llama_index.llms.ragblend import (  # noqa: E402
    BlendLLM,
    BlendSynthesizer,
    BlendWarmup,
    MiniLMEmbedding,
    WarmingRetriever,
    blend_query_engine,
)

QUESTION = "Where was Thomas Nabbes educated?"
TEXTS = [
    "Thomas Nabbes was an English dramatist. He was educated at Exeter College, Oxford.",
    "Exeter College is a constituent college of the University of Oxford, founded in 1314.",
]


@pytest.fixture(scope="module")
def llm(embedded_engine):
    llm = BlendLLM(engine=embedded_engine, max_new_tokens=4)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def index(llm) -> VectorStoreIndex:
    embed = MiniLMEmbedding()
    index = VectorStoreIndex.from_documents(
        [Document(text=t) for t in TEXTS],
        embed_model=embed,
        transformations=[SentenceSplitter(chunk_size=1024), embed, BlendWarmup(llm)],
    )
    assert llm.wait_for_warmup(timeout=300)
    return index


def test_deprecated_names_are_methods_not_pydantic_fields():
    assert "as_query_engine" not in BlendLLM.model_fields
    assert "synthesizer" not in BlendLLM.model_fields


def test_as_query_engine_warns_naming_blend_query_engine_and_builds_the_same_engine(llm, index):
    with pytest.warns(DeprecationWarning, match=r"blend_query_engine\(llm, index") as caught:
        old = llm.as_query_engine(index, similarity_top_k=2)
    assert caught[0].filename == __file__  # the warning points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        new = blend_query_engine(llm, index, similarity_top_k=2)

    for engine in (old, new):
        assert isinstance(engine, RetrieverQueryEngine)
        assert isinstance(engine.retriever, WarmingRetriever)
        assert isinstance(engine._response_synthesizer, BlendSynthesizer)
    old_text = str(old.query(QUESTION))
    old_stats = llm.last_stats
    assert str(new.query(QUESTION)) == old_text
    assert old_stats.mode == "blend"
    assert old_stats.chunk_hits == 2 and old_stats.chunk_misses == 0


def test_synthesizer_warns_naming_blend_synthesizer(llm):
    with pytest.warns(DeprecationWarning, match=r"blend_synthesizer\(llm"):
        synth = llm.synthesizer(streaming=True)
    assert isinstance(synth, BlendSynthesizer)
    assert synth._streaming is True
