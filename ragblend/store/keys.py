"""Content-addressed keys for chunk KV caches."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from ragblend.models.quantized import QuantizedWeight, quantized_weights

KEY_VERSION = 2


def model_fingerprint(model: torch.nn.Module) -> str:
    """Hash of the model's config and a sample of its weights (tells random inits apart).

    A quantized weight is sampled as its dequantized values, so a GGUF's model has one
    fingerprint whether its quantized tensors are kept or dequantized (the same KV)."""
    h = hashlib.sha256()
    config: Any = model.config
    h.update(config.to_json_string(use_diff=False).encode())
    params = dict(model.named_parameters())
    dtype = next(iter(params.values())).dtype if params else torch.float32
    weights: dict[str, torch.Tensor | QuantizedWeight] = dict(params)
    shared: set[int] = set()
    for name, weight in quantized_weights(model).items():
        if id(weight.blocks) not in shared:  # a tied LM head is its embedding, counted once
            shared.add(id(weight.blocks))
            weights[name] = weight
    for name in sorted(weights)[:: max(1, len(weights) // 8)]:
        h.update(name.encode())
        h.update(_sample(weights[name], dtype).numpy().tobytes())
    return h.hexdigest()[:32]


def _sample(
    weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype, size: int = 4096
) -> torch.Tensor:
    """The first ``size`` values of ``weight`` (flattened; quantized ones dequantized to the
    model's ``dtype``) as fp32 on CPU."""
    if isinstance(weight, QuantizedWeight):
        rows = torch.arange(min(weight.rows, -(-size // weight.cols)))
        return weight.dequantize(dtype, rows).reshape(-1)[:size].float()
    return weight.detach().reshape(-1)[:size].to("cpu", torch.float32)


def _ids_bytes(ids: Sequence[int]) -> bytes:
    return torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes()


def ids_digest(ids: Sequence[int]) -> str:
    """A short digest of token ``ids`` (16 hex digits): how an entry's ``meta`` names the
    neighbours it was precomputed after, so a prompt can tell whether a chunk's predecessor
    was one of them."""
    return hashlib.sha256(_ids_bytes(ids)).hexdigest()[:16]


def chunk_key(
    *,
    fingerprint: str,
    dtype: torch.dtype | str,
    kv_dtype: str,
    context_ids: Sequence[int],
    chunk_ids: Sequence[int],
    namespace: str | None = None,
    tag: str = "",
) -> str:
    """Key of one chunk's KV: model, compute and storage dtypes, tenant namespace, the
    precompute context and the chunk's token ids.

    Independent of where the chunk appears in a prompt, so a permuted retrieval still hits.
    Keyword-only so that callers cannot swap the context and the chunk. The namespace salts
    every key: tenants never share (or probe) each other's entries. ``tag`` names a second
    kind of entry for the same chunk (``"isolated"``: a neighbour's KV computed alone while
    precomputing, kept apart from the chunk's own cache); untagged keys are unchanged by it.
    """
    h = hashlib.sha256()
    h.update(f"ragblend-kv-v{KEY_VERSION}|{fingerprint}|{dtype}|{kv_dtype}|".encode())
    h.update(f"ns={namespace or ''}|".encode())
    if tag:
        h.update(f"tag={tag}|".encode())
    h.update(_ids_bytes(context_ids))
    h.update(b"|")
    h.update(_ids_bytes(chunk_ids))
    return h.hexdigest()
