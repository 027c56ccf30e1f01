"""Neighbour sources for a MuSiQue-format dataset (``--precompute-context neighbours|previous``).

``neighbours``: every passage of every case in the file (cut as the bench cuts chunks), embedded
with the integrations' MiniLM, so a chunk's neighbours are the corpus passages most similar to
it, never anything derived from the question. ``previous``: each case's passages in their order
form one document.
"""

from __future__ import annotations

from pathlib import Path

from ragblend.bench.datasets import dataset_passages
from ragblend.errors import RagblendError
from ragblend.neighbours import DocumentOrder, NeighbourIndex, NeighbourSource


def dataset_neighbours(
    kind: str,
    path: str | Path,
    tokenizer,
    chunk_tokens: int,
    namespace: str | None = None,
) -> NeighbourSource:
    """The neighbour source of precompute context ``kind`` over the passages of ``path``."""
    documents = dataset_passages(path, tokenizer, chunk_tokens)
    if kind == "previous":
        order = DocumentOrder()
        for passages in documents:
            order.add_document(passages, namespace)
        return order
    if kind == "neighbours":
        from ragblend.embeddings import embed

        texts = list(dict.fromkeys(p for passages in documents for p in passages))
        index = NeighbourIndex()
        index.add(texts, embed(texts), namespace)
        return index
    raise RagblendError(f"precompute context {kind!r} has no neighbours")
