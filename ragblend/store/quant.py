"""Storage dtypes of chunk KV: what a tier persists for each layer, and how it is read back.

Every entry a tier persists exposes ``stored_layer(i)`` (the named tensors stored for layer
``i``) and a JSON-able ``meta`` with ``kv_dtype``; ``decode_layer(meta, tensors)`` turns what was
stored back into compute-dtype K and V. Float storage dtypes store ``{"k", "v"}`` as they are.
"""

from __future__ import annotations

import torch

from ragblend.errors import RagblendError
from ragblend.store.base import ChunkKV, KVEntry

FLOAT_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pack(kv: ChunkKV, kv_dtype: str) -> KVEntry:
    """``kv`` (compute dtype) as stored in ``kv_dtype``; ``meta["kv_dtype"]`` records it."""
    meta = {**kv.meta, "kv_dtype": kv_dtype, "compute_dtype": _name(kv.k.dtype)}
    if kv_dtype in FLOAT_KV_DTYPES:
        dtype = FLOAT_KV_DTYPES[kv_dtype]
        return ChunkKV(k=kv.k.to(dtype), v=kv.v.to(dtype), meta=meta)
    raise RagblendError(f"kv_dtype {kv_dtype!r} is not supported for storage")


def decode_layer(
    meta: dict, tensors: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute-dtype K and V of one layer from what ``stored_layer`` stored."""
    compute = FLOAT_KV_DTYPES.get(meta.get("compute_dtype", ""), tensors["k"].dtype)
    return tensors["k"].to(compute), tensors["v"].to(compute)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
