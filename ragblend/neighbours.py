"""Which chunks a chunk's KV is precomputed after (``precompute_context="neighbours"``).

A chunk cache computed after the chunks most likely to be retrieved with it (FusionRAG) needs
less correction at query time than one computed alone. Two sources of those neighbours:

- :class:`NeighbourIndex`: the ``n`` chunks most similar to it (cosine over the embeddings
  the caller already has: a vector store's at ingestion, ``ragblend warmup``'s);
- :class:`DocumentOrder`: the chunk before it in its document (``"previous"``).

Both are bounded by namespace (a tenant's chunks never precede another tenant's) and answer
with texts only; a chunk they do not know has no neighbours (it is computed as today).
The engine asks its source (``BlendEngine.neighbours``) when it warms a chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from ragblend.errors import RagblendError


@runtime_checkable
class NeighbourSource(Protocol):
    """Anything that names the chunks a chunk should be precomputed after."""

    def neighbours(self, text: str, n: int, namespace: str | None = None) -> list[str]:
        """Up to ``n`` chunk texts to put before ``text``, least relevant first."""
        ...


class NeighbourIndex:
    """Chunk embeddings by namespace; a chunk's neighbours are its ``n`` nearest by cosine.

    >>> index = NeighbourIndex()
    >>> index.add(texts, vectors)               # e.g. what the vector store embedded
    >>> engine.neighbours = index
    >>> engine.with_config(precompute_context="neighbours").precompute(texts)
    """

    def __init__(self) -> None:
        self._texts: dict[str | None, list[str]] = {}
        self._rows: dict[str | None, dict[str, int]] = {}
        self._parts: dict[str | None, list[torch.Tensor]] = {}
        self._matrix: dict[str | None, torch.Tensor] = {}

    def add(
        self,
        texts: Sequence[str],
        embeddings: Sequence[Sequence[float]] | torch.Tensor,
        namespace: str | None = None,
    ) -> None:
        """Record ``texts`` with their ``embeddings`` (one vector each) under ``namespace``.
        A text already known keeps its first vector."""
        vectors = torch.as_tensor(embeddings, dtype=torch.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(texts):
            raise RagblendError(
                f"NeighbourIndex.add needs one embedding vector per text: {len(texts)} texts, "
                f"embeddings of shape {tuple(vectors.shape)}"
            )
        known = self._matrix.get(namespace)
        dim = known.shape[1] if known is not None else None
        parts = self._parts.setdefault(namespace, [])
        if dim is None and parts:
            dim = parts[0].shape[1]
        if dim is not None and vectors.shape[1] != dim:
            raise RagblendError(
                f"embeddings of {vectors.shape[1]} dimensions, the index holds {dim}-dimensional"
            )
        rows = self._rows.setdefault(namespace, {})
        names = self._texts.setdefault(namespace, [])
        fresh = []
        for i, text in enumerate(texts):
            if text not in rows:
                rows[text] = len(names)
                names.append(text)
                fresh.append(i)
        if fresh:
            unit = torch.nn.functional.normalize(vectors[fresh], dim=1)
            parts.append(unit)

    def __len__(self) -> int:
        return sum(len(t) for t in self._texts.values())

    def _vectors(self, namespace: str | None) -> torch.Tensor | None:
        parts = self._parts.get(namespace)
        if parts:  # stacked lazily: ingestion adds a few at a time, warmup reads many times
            known = self._matrix.get(namespace)
            self._matrix[namespace] = torch.cat(([known] if known is not None else []) + parts)
            parts.clear()
        return self._matrix.get(namespace)

    def neighbours(self, text: str, n: int, namespace: str | None = None) -> list[str]:
        """The ``n`` known chunks most similar to ``text`` (itself and exact duplicates
        excluded), least similar first so the most similar sits next to the chunk; ``[]``
        when ``text`` is not in the index."""
        row = self._rows.get(namespace, {}).get(text)
        matrix = self._vectors(namespace)
        if row is None or matrix is None or n < 1:
            return []
        sims = matrix @ matrix[row]
        sims[row] = -float("inf")
        k = min(n, matrix.shape[0] - 1)
        if k < 1:
            return []
        top = torch.topk(sims, k).indices.tolist()
        names = self._texts[namespace]
        return [names[i] for i in reversed(top)]


class DocumentOrder:
    """The chunk before each chunk in its document (``precompute_context="previous"``)."""

    def __init__(self) -> None:
        self._previous: dict[str | None, dict[str, list[str]]] = {}

    def add_document(self, chunks: Sequence[str], namespace: str | None = None) -> None:
        """Record a document's chunks in their order (a chunk's first document wins)."""
        known = self._previous.setdefault(namespace, {})
        for i, text in enumerate(chunks):
            known.setdefault(text, list(chunks[max(0, i - 1) : i]))

    def neighbours(self, text: str, n: int, namespace: str | None = None) -> list[str]:
        """The chunk before ``text`` in its document (``[]`` for a first or unknown chunk);
        ``n`` is ignored beyond 0."""
        if n < 1:
            return []
        return list(self._previous.get(namespace, {}).get(text, []))
