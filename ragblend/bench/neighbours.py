"""Neighbour sources for a MuSiQue-format dataset (``--precompute-context neighbours|previous``).

``neighbours``: every passage of every case in the file (cut as the bench cuts chunks), embedded
with the integrations' MiniLM, so a chunk's neighbours are the corpus passages most similar to
it, never anything derived from the question. ``previous``: each case's passages in their order
form one document.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ragblend.bench.datasets import dataset_passages
from ragblend.errors import RagblendError
from ragblend.neighbours import DocumentOrder, NeighbourIndex, NeighbourSource

if TYPE_CHECKING:
    from ragblend.engine import BlendEngine

log = logging.getLogger(__name__)


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


def with_dataset_neighbours(
    engine: BlendEngine, path: str | Path, chunk_tokens: int, explicit: bool
) -> BlendEngine:
    """``engine`` with the neighbour source of its precompute context over ``path``'s
    passages (unchanged outside neighbour contexts). Where the context is only the default
    (not ``explicit``) and MiniLM is not installed, a view precomputing as ``"canonical"``
    (with a warning): the default never needs the optional extra."""
    from ragblend.config import NEIGHBOUR_CONTEXTS
    from ragblend.embeddings import EmbeddingsUnavailable

    config = engine.config
    if config.precompute_context not in NEIGHBOUR_CONTEXTS:
        return engine
    try:
        source = dataset_neighbours(
            config.precompute_context, path, engine.tokenizer, chunk_tokens, config.namespace
        )
    except EmbeddingsUnavailable as exc:
        if explicit:
            raise
        log.warning("chunks are precomputed alone (precompute_context='canonical'): %s", exc)
        return engine.with_config(precompute_context="canonical")
    return engine.with_config(neighbours=source)
