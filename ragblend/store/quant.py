"""Storage dtypes of chunk KV: what a tier persists for each layer, and how it is read back.

Every entry a tier persists exposes ``stored_layer(i)`` (the named tensors stored for layer
``i``) and a JSON-able ``meta`` with ``kv_dtype`` and ``compute_dtype``; ``decode_layer(meta,
tensors)`` turns what was stored back into compute-dtype K and V, and ``from_stored(meta,
stacked)`` rebuilds a whole entry from its stored tensors stacked over layers.

Float storage dtypes store ``{"k", "v"}`` as they are. ``int8`` stores symmetric 8-bit codes
with float32 scales, as KIVI/KVQuant recommend for pre-RoPE keys and values:

- keys per channel: ``k ≈ k_q * k_scale``, ``k_scale`` [kv_heads, 1, head_dim] (one scale per
  head and channel over the chunk's tokens — key outliers live in fixed channels);
- values per token: ``v ≈ v_q * v_scale``, ``v_scale`` [kv_heads, tokens, 1].
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ragblend.errors import RagblendError
from ragblend.store.base import ChunkKV, KVEntry

FLOAT_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANT_KV_DTYPES = ("int8",)
STORAGE_KV_DTYPES = (*FLOAT_KV_DTYPES, *QUANT_KV_DTYPES)
_INT8_MAX = 127.0


def pack(kv: ChunkKV, kv_dtype: str) -> KVEntry:
    """``kv`` (compute dtype) as stored in ``kv_dtype``; ``meta["kv_dtype"]`` records it."""
    meta = {**kv.meta, "kv_dtype": kv_dtype, "compute_dtype": dtype_name(kv.k.dtype)}
    if kv_dtype in FLOAT_KV_DTYPES:
        dtype = FLOAT_KV_DTYPES[kv_dtype]
        return ChunkKV(k=kv.k.to(dtype), v=kv.v.to(dtype), meta=meta)
    if kv_dtype == "int8":
        k_q, k_scale = quantize_int8(kv.k, dim=-2)  # per channel: reduce over tokens
        v_q, v_scale = quantize_int8(kv.v, dim=-1)  # per token: reduce over channels
        tensors = {"k": k_q, "k_scale": k_scale, "v": v_q, "v_scale": v_scale}
        return QuantizedKV(tensors=tensors, meta=meta)
    raise RagblendError(
        f"kv_dtype {kv_dtype!r} is not supported for storage; expected one of "
        f"{', '.join(STORAGE_KV_DTYPES)}"
    )


def quantize_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``x`` with one float32 scale per slice along ``dim``.

    ``x`` [..., tokens, head_dim] → (codes int8 like ``x``, scales float32 with ``dim`` kept
    as size 1); ``codes * scales`` approximates ``x`` within ``scales / 2`` per element.
    """
    x = x.float()
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / _INT8_MAX
    codes = torch.round(x / scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return codes.contiguous(), scale.contiguous()


def decode_layer(meta: dict, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute-dtype K and V of one layer, [kv_heads, tokens, head_dim], from what
    ``stored_layer`` stored (``{"k", "v"}``, plus ``k_scale``/``v_scale`` for int8)."""
    compute = FLOAT_KV_DTYPES.get(meta.get("compute_dtype", ""))
    if "k_scale" in tensors:
        dtype = compute or torch.float32
        k = (tensors["k"].float() * tensors["k_scale"]).to(dtype)
        v = (tensors["v"].float() * tensors["v_scale"]).to(dtype)
        return k, v
    dtype = compute or tensors["k"].dtype
    return tensors["k"].to(dtype), tensors["v"].to(dtype)


def from_stored(meta: dict, stacked: dict[str, torch.Tensor]) -> ChunkKV | QuantizedKV:
    """The entry whose ``stored_layer(i)`` is ``{name: t[i]}`` for each stacked tensor
    [layers, ...]: a ``ChunkKV`` for float storage, a ``QuantizedKV`` otherwise."""
    if set(stacked) == {"k", "v"}:
        return ChunkKV(k=stacked["k"], v=stacked["v"], meta=meta)
    return QuantizedKV(tensors=dict(stacked), meta=meta)


def kv_bytes_per_token(
    kv_dtype: str, layers: int, kv_heads: int, head_dim: int, chunk_tokens: int
) -> float:
    """Stored bytes per token of a ``chunk_tokens``-token chunk in ``kv_dtype`` (K and V of
    every layer, scales included; per-channel key scales are shared by the chunk's tokens)."""
    values = 2 * layers * kv_heads * head_dim
    if kv_dtype in FLOAT_KV_DTYPES:
        return float(values * FLOAT_KV_DTYPES[kv_dtype].itemsize)
    if kv_dtype == "int8":
        scales = layers * kv_heads * (4 + 4 * head_dim / max(1, chunk_tokens))
        return values + scales
    raise RagblendError(f"kv_dtype {kv_dtype!r} is not supported for storage")


def stored_bytes_per_token(entry: KVEntry) -> float:
    """Bytes the entry stores per token, every layer and the scales included."""
    return entry.nbytes / max(1, entry.num_tokens)


@dataclass(frozen=True)
class QuantizedKV:
    """A quantised chunk entry held in memory: stored tensors stacked over layers.

    ``tensors``: ``k``/``v`` int8 [layers, kv_heads, tokens, head_dim], ``k_scale``
    [layers, kv_heads, 1, head_dim], ``v_scale`` [layers, kv_heads, tokens, 1] (float32).
    ``layer(i)`` dequantises to the compute dtype (in the layer loader, never the fusor).
    """

    tensors: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.tensors["k"].shape[2])

    @property
    def num_layers(self) -> int:
        return int(self.tensors["k"].shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def stored_layer(self, index: int) -> dict[str, torch.Tensor]:
        return {name: t[index] for name, t in self.tensors.items()}

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return decode_layer(self.meta, self.stored_layer(index))

    def materialize(self) -> ChunkKV:
        layers = [self.layer(i) for i in range(self.num_layers)]
        k = torch.stack([k for k, _ in layers])
        v = torch.stack([v for _, v in layers])
        return ChunkKV(k=k, v=v, meta=dict(self.meta))


def in_memory(entry: KVEntry) -> ChunkKV | QuantizedKV:
    """``entry`` with its stored tensors in memory (a lazy entry is read in full, verified)."""
    if isinstance(entry, (ChunkKV, QuantizedKV)):
        return entry
    layers = [entry.stored_layer(i) for i in range(entry.num_layers)]
    stacked = {name: torch.stack([layer[name] for layer in layers]) for name in layers[0]}
    return from_stored(dict(entry.meta), stacked)


def to_cpu(entry: KVEntry) -> ChunkKV | QuantizedKV:
    """``entry`` in CPU memory, as stored."""
    held = in_memory(entry)
    if isinstance(held, ChunkKV):
        if held.k.device.type == "cpu":
            return held
        return ChunkKV(held.k.to("cpu"), held.v.to("cpu"), held.meta)
    return QuantizedKV({n: t.to("cpu") for n, t in held.tensors.items()}, held.meta)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` → ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")
