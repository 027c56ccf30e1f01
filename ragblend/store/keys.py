"""Content-addressed keys for chunk KV caches."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

KEY_VERSION = 2


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of the model's config and a sample of its weights (tells random inits apart)."""
    h = hashlib.sha256()
    config: Any = model.config
    h.update(config.to_json_string(use_diff=False).encode())
    params = dict(model.named_parameters())
    for name in sorted(params)[:: max(1, len(params) // 8)]:
        sample = params[name].detach().reshape(-1)[:4096].to("cpu", torch.float32)
        h.update(name.encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]


def _ids_bytes(ids: Sequence[int]) -> bytes:
    return torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes()


def chunk_key(
    *,
    fingerprint: str,
    dtype: torch.dtype | str,
    kv_dtype: str,
    context_ids: Sequence[int],
    chunk_ids: Sequence[int],
    namespace: str | None = None,
) -> str:
    """Key of one chunk's KV: model, compute and storage dtypes, tenant namespace, the
    precompute context and the chunk's token ids.

    Independent of where the chunk appears in a prompt, so a permuted retrieval still hits.
    Keyword-only so that callers cannot swap the context and the chunk. The namespace salts
    every key: tenants never share (or probe) each other's entries.
    """
    h = hashlib.sha256()
    h.update(f"ragblend-kv-v{KEY_VERSION}|{fingerprint}|{dtype}|{kv_dtype}|".encode())
    h.update(f"ns={namespace or ''}|".encode())
    h.update(_ids_bytes(context_ids))
    h.update(b"|")
    h.update(_ids_bytes(chunk_ids))
    return h.hexdigest()
