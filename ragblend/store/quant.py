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

``int4``, ``int2``, ``k8v4`` and ``k4v8`` are group-wise codes (``ragblend.store.groupwise``);
``pca<bits>`` (e.g. ``pca2``: 2 bits a value) the transform coder (``ragblend.store.transform``),
whose entries name the model's calibration basis (``meta["basis"]``, ``ragblend.store.basis``) and
decode only where that basis is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ragblend.errors import CorruptEntryError, RagblendError
from ragblend.store import basis as bases
from ragblend.store import groupwise, transform
from ragblend.store.base import ChunkKV, KVEntry

FLOAT_KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANT_KV_DTYPES = ("int8", *groupwise.GROUPWISE_BITS)
STORAGE_KV_DTYPES = (*FLOAT_KV_DTYPES, *QUANT_KV_DTYPES, "pca<bits>")
_INT8_MAX = 127.0
# kv_dtype="auto" by compute dtype, chosen on the fidelity–bytes frontier (docs/stores.md, issue
# 70): on a float32 model, int8 entries (a quarter of float32's bytes) matched float32 and
# bfloat16 entries in blend's fidelity, at 0.90x float32's speed and 1.04x bfloat16's; other
# compute dtypes store themselves (int8 is not measured there)
AUTO_KV_DTYPES = {"float32": "int8"}


def auto_kv_dtype(compute: torch.dtype) -> str:
    """What ``kv_dtype="auto"`` stores chunk KV of a ``compute``-dtype model in."""
    name = dtype_name(compute)
    return AUTO_KV_DTYPES.get(name, name)


def needs_basis(kv_dtype: str) -> bool:
    """Whether ``kv_dtype`` is a transform coder (its entries need the model's basis)."""
    return transform.pca_bits(kv_dtype) is not None


def pack(kv: ChunkKV, kv_dtype: str, basis: transform.Basis | None = None) -> KVEntry:
    """``kv`` (compute dtype) as stored in ``kv_dtype``; ``meta["kv_dtype"]`` records it
    (``basis``: the model's, for a ``pca<bits>`` codec; ``meta["basis"]`` records its id)."""
    meta = {**kv.meta, "kv_dtype": kv_dtype, "compute_dtype": dtype_name(kv.k.dtype)}
    if kv_dtype in FLOAT_KV_DTYPES:
        dtype = FLOAT_KV_DTYPES[kv_dtype]
        return ChunkKV(k=kv.k.to(dtype), v=kv.v.to(dtype), meta=meta)
    if kv_dtype == "int8":
        k_q, k_scale = quantize_int8(kv.k, dim=-2)  # per channel: reduce over tokens
        v_q, v_scale = quantize_int8(kv.v, dim=-1)  # per token: reduce over channels
        tensors = {"k": k_q, "k_scale": k_scale, "v": v_q, "v_scale": v_scale}
        return QuantizedKV(tensors=tensors, meta=meta)
    if kv_dtype in groupwise.GROUPWISE_BITS:
        tensors = groupwise.encode(kv.k, kv.v, groupwise.GROUPWISE_BITS[kv_dtype])
        return QuantizedKV(tensors=tensors, meta=meta)
    bits = transform.pca_bits(kv_dtype)
    if bits is not None:
        if basis is None:
            raise RagblendError(f"kv_dtype {kv_dtype!r} needs the model's calibration basis")
        if basis.shape != (kv.num_layers, int(kv.k.shape[1]), int(kv.k.shape[3])):
            raise RagblendError(f"basis of shape {basis.shape} does not fit this KV")
        return QuantizedKV(tensors=_pca_encode(kv, basis, bits), meta={**meta, "basis": basis.id})
    raise RagblendError(
        f"kv_dtype {kv_dtype!r} is not supported for storage; expected one of "
        f"{', '.join(STORAGE_KV_DTYPES)}"
    )


def _pca_encode(kv: ChunkKV, basis: transform.Basis, bits: float) -> dict[str, torch.Tensor]:
    """Every layer's transform codes, stacked over layers."""
    layers: dict[str, list[torch.Tensor]] = {"k": [], "k_stats": [], "v": [], "v_stats": []}
    for i in range(kv.num_layers):
        for name, x, rotation in (("k", kv.k[i], basis.k[i]), ("v", kv.v[i], basis.v[i])):
            coded = transform.encode_tensor(x.to("cpu"), rotation, bits)
            layers[name].append(coded["codes"])
            layers[f"{name}_stats"].append(coded["stats"])
    return {name: torch.stack(ts).contiguous() for name, ts in layers.items()}


def quantize_int8(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes of ``x`` with one float32 scale per slice along ``dim``.

    ``x`` [..., tokens, head_dim] → (codes int8 like ``x``, scales float32 with ``dim`` kept
    as size 1); ``codes * scales`` approximates ``x`` within ``scales / 2`` per element.
    """
    x = x.float()
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / _INT8_MAX
    codes = torch.round(x / scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return codes.contiguous(), scale.contiguous()


def decode_layer(
    meta: dict, tensors: dict[str, torch.Tensor], index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute-dtype K and V of layer ``index``, [kv_heads, tokens, head_dim], from what
    ``stored_layer(index)`` stored (``{"k", "v"}``, plus scales or statistics for a code)."""
    compute = FLOAT_KV_DTYPES.get(meta.get("compute_dtype", ""))
    kv_dtype = str(meta.get("kv_dtype", ""))
    if kv_dtype in groupwise.GROUPWISE_BITS:
        return groupwise.decode(
            tensors, groupwise.GROUPWISE_BITS[kv_dtype], compute or torch.float32
        )
    bits = transform.pca_bits(kv_dtype)
    if bits is not None:
        return _pca_decode(meta, tensors, index, bits, compute or torch.float32)
    if "k_scale" in tensors:
        dtype = compute or torch.float32
        k = (tensors["k"].float() * tensors["k_scale"]).to(dtype)
        v = (tensors["v"].float() * tensors["v_scale"]).to(dtype)
        return k, v
    dtype = compute or tensors["k"].dtype
    return tensors["k"].to(dtype), tensors["v"].to(dtype)


def _pca_decode(
    meta: dict, tensors: dict[str, torch.Tensor], index: int, bits: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    basis = bases.loaded(str(meta.get("basis", "")))
    if basis is None:  # the ChunkCache loads it before looking entries up: this is a foreign entry
        raise CorruptEntryError(str(meta.get("key", "")), "its calibration basis is not loaded")
    k = transform.decode_tensor(tensors["k"], tensors["k_stats"], basis.k[index], bits)
    v = transform.decode_tensor(tensors["v"], tensors["v_stats"], basis.v[index], bits)
    return k.to(dtype), v.to(dtype)


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
    if kv_dtype in groupwise.GROUPWISE_BITS:
        bits = groupwise.GROUPWISE_BITS[kv_dtype]
        return groupwise.bytes_per_token(bits, layers, kv_heads, head_dim, chunk_tokens)
    pca = transform.pca_bits(kv_dtype)
    if pca is not None:
        return transform.bytes_per_token(pca, layers, kv_heads, head_dim, chunk_tokens)
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
        return decode_layer(self.meta, self.stored_layer(index), index)

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
