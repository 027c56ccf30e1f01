"""BlendWarmup gives a neighbour-context engine the nodes' embeddings."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.schema import TextNode  # noqa: E402
from ragblend.neighbours import NeighbourIndex  # noqa: E402
from ragblend.store.memory import MemoryStore  # noqa: E402

from llama_index.llms.ragblend import BlendLLM, BlendWarmup  # noqa: E402

TEXTS = [
    "Hannibal and Scipio is a Caroline era stage play written by Thomas Nabbes in 1635.",
    "Thomas Nabbes was an English dramatist. He was educated at Exeter College, Oxford.",
    "The Punica is a Latin epic poem in seventeen books written by Silius Italicus.",
]


def test_embedded_nodes_become_each_others_neighbours_at_ingestion(embedded_engine):
    engine = embedded_engine.with_config(
        precompute_context="neighbours", store=MemoryStore(), neighbours=NeighbourIndex()
    )  # its own index: the session's engine may know other nodes (another embedding model)
    llm = BlendLLM(engine=engine, max_new_tokens=4)
    try:
        vectors = [[1.0, 0.1], [0.9, 0.2], [0.0, 1.0]]
        nodes = [TextNode(text=t, embedding=v) for t, v in zip(TEXTS, vectors)]
        nodes.append(TextNode(text="A node embedded later has no neighbours yet."))
        assert BlendWarmup(llm)(nodes) == nodes
        llm.wait_for_warmup()
        content = [n.get_content(metadata_mode="llm") for n in nodes]
        assert engine.neighbours.neighbours(content[0], 1) == [content[1]]
        assert engine.neighbour_ids(content[3]) == []
        assert all(llm.is_cached(c) for c in content)
    finally:
        llm.close()
