"""A persistent, fully offline Chroma store (no default embedding function, no telemetry)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from langchain_core.embeddings import Embeddings

from langchain_ragblend.embeddings import MiniLMEmbeddings


def offline_chroma(
    persist_directory: str | Path,
    collection_name: str = "ragblend",
    embedding: Embeddings | None = None,
    **kwargs: Any,
) -> Any:
    """``langchain_chroma.Chroma`` persisted in ``persist_directory`` with local embeddings.

    ``embedding`` defaults to :class:`MiniLMEmbeddings`; Chroma's own default embedding
    function is never used and telemetry is off.
    """
    from chromadb.config import Settings
    from langchain_chroma import Chroma

    kwargs.setdefault("client_settings", Settings(anonymized_telemetry=False))
    return Chroma(
        collection_name=collection_name,
        embedding_function=embedding or MiniLMEmbeddings(),
        persist_directory=str(persist_directory),
        **kwargs,
    )
