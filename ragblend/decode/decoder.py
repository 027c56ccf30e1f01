"""Decoding one token at a time through the layer-wise adapter, into preallocated K/V.

After the prefill, each new token is a single query row: per layer, the model's own norm and
projections (``LayerwiseModel.project``), its K/V written in place at the token's position,
attention of that one row over the keys before it (a slice of the preallocated buffer, so no
mask and no padded keys), then o_proj and the MLP (``LayerwiseModel.finish``). The same HF
modules as ``model(...)``, without the per-step work of HF's forward (mask construction, cache
bookkeeping, output objects), which dominates decode time for small models on CPU.

Given ragblend's native kernels (:mod:`ragblend.kernels.cpu.native`), a step's RoPE and RMSNorms
are the kernels' (HF's values bit for bit) and the attention of all requests is one kernel
call that also writes their new K/V (:mod:`ragblend.kernels.cpu.decode_kernels`): bf16 dot
products for a bf16 model on a CPU at the ``avx512_bf16`` level, else the fp32 kernel (over a
bf16 model's bf16 K/V, widened to fp32 as it is read; :func:`decode_attention`); elsewhere,
torch's ops per request.

With ``kv_cache_dtype="int8"`` the decode buffers hold 8-bit codes with scales instead
(:func:`ragblend.kernels.cpu.decode_q8.quantize_q8`: llama.cpp's q8_0, one fp32 scale per 32
values along the head dim), the prompt's K/V quantized once when the decoder is made and each
new token's as it is written; a step attends in fp32 over the dequantized values, through the
native AVX2 kernel (``csrc/decode_attention_int8.cpp``) or, where it does not run, SDPA per
request (:func:`ragblend.kernels.cpu.decode_q8.attend_q8_torch`).

On a GPU (``BlendConfig.decode_slots``) the decoders' buffers are slots of one static
:class:`~ragblend.decode.pool.DecodePool`, and a step of requests that share it writes and
attends all of them in one call per layer, through the fused layer steps where the engine
runs them (``BlendConfig.layer_kernels``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F

from ragblend.config import KV_CACHE_DTYPES
from ragblend.decode.layers import step_layers
from ragblend.decode.pool import DecodePool
from ragblend.errors import RagblendError
from ragblend.kernels import (
    DecodeKernel,
    LayerKernels,
    NativeKernels,
    int8_attention,
    native_kernels,
    q8_buffer,
    step_activations,
)
from ragblend.models.adapters import LayerProjections, LayerwiseModel


class DecodeAttention(NamedTuple):
    """A native decode-step attention kernel and the dtype its q takes (its K/V: the
    buffers', which the kernel checks)."""

    kernel: DecodeKernel
    q_dtype: torch.dtype


class LayerDecoder:
    """Greedy-or-sampled decoding state of one request: K/V buffers and the next position.

    ``keys[i]`` / ``values[i]``: [1, kv_heads, capacity, head_dim], post-RoPE keys, filled with
    the prompt's cache up to ``position`` (a sliding-window layer's cache holds only the last
    tokens before it: what the window reads). The prompt cache itself is never modified.
    ``kernels``: ragblend's native CPU kernels to step with (see the module docstring).

    ``kv_cache_dtype="int8"``: ``keys[i]`` / ``values[i]`` are int8 codes of that shape and
    ``key_scales[i]`` / ``value_scales[i]`` their fp32 scales [1, kv_heads, capacity,
    head_dim / block] (block: 32, or head_dim where 32 does not divide it; see
    :func:`ragblend.kernels.cpu.decode_q8.quantize_q8`), ``attend_q8`` the attention that
    reads them. ``"auto"``: the prompt cache's dtype, scales empty.

    ``activations``: what a step multiplies a GGUF's quantized weights by, a resolved
    ``BlendConfig.decode_activations`` (``"float"`` or ``"int8"``:
    :func:`ragblend.kernels.cpu.int8_decode.step_activations`).

    ``pool``: a :class:`~ragblend.decode.pool.DecodePool` to take a slot of (``auto`` K/V of
    at most its capacity): the buffers are views of it, and a step of decoders that all hold
    slots of one pool attends in one call (``slot`` is None where it had none free).
    ``layer_kernels``: the fused layer steps (``BlendEngine.layer_kernels``) a step runs.
    """

    def __init__(
        self,
        layers: LayerwiseModel,
        prompt_kv: Sequence[tuple[torch.Tensor, torch.Tensor]],
        capacity: int,
        position: int | None = None,
        kernels: NativeKernels | None = None,
        kv_cache_dtype: str = "auto",
        activations: str = "float",
        pool: DecodePool | None = None,
        layer_kernels: LayerKernels | None = None,
    ):
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise RagblendError(
                f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected one of "
                f"{', '.join(KV_CACHE_DTYPES)}"
            )
        self.layers = layers
        self.kernels = kernels
        self.kv_cache_dtype = kv_cache_dtype
        self.activations = activations
        self.attend = decode_attention(layers, kernels)
        self.position = (
            max(int(k.shape[-2]) for k, _ in prompt_kv) if position is None else position
        )
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.key_scales: list[torch.Tensor] = []
        self.value_scales: list[torch.Tensor] = []
        self.capacity = capacity
        self.layer_kernels = layer_kernels
        self.pool: DecodePool | None = None
        self.slot: int | None = None
        if pool is not None and kv_cache_dtype == "auto" and capacity <= pool.capacity:
            self.slot = pool.claim(self)
            self.pool = pool if self.slot is not None else None
        if kv_cache_dtype == "int8":
            self.attend_q8 = int8_attention(layers.device, layers.dtype, layers.head_dim, kernels)
            for k, v in prompt_kv:
                for buffers, scales, x in (
                    (self.keys, self.key_scales, k),
                    (self.values, self.value_scales, v),
                ):
                    codes, s = q8_buffer(x, capacity, self.position)
                    buffers.append(codes)
                    scales.append(s)
            return
        p = self.position
        for i, (k, v) in enumerate(prompt_kv):
            if self.pool is not None:
                slot = slice(self.slot, cast(int, self.slot) + 1)
                kb, vb = self.pool.keys[i][slot], self.pool.values[i][slot]
            else:
                kb = k.new_empty(*k.shape[:-2], capacity, k.shape[-1])
                vb = v.new_empty(*v.shape[:-2], capacity, v.shape[-1])
            kb[..., p - k.shape[-2] : p, :].copy_(k)
            vb[..., p - v.shape[-2] : p, :].copy_(v)
            self.keys.append(kb)
            self.values.append(vb)

    @classmethod
    def for_cache(
        cls,
        layers: LayerwiseModel,
        prompt_cache: Any,
        prompt_len: int,
        total_len: int,
        kernels: NativeKernels | None = None,
        kv_cache_dtype: str = "auto",
        activations: str = "float",
        pool: DecodePool | None = None,
        layer_kernels: LayerKernels | None = None,
    ) -> LayerDecoder | None:
        """A decoder over ``prompt_cache`` (an HF cache of ``prompt_len`` tokens) with room
        for ``total_len`` tokens, or None where it does not apply: a layer whose cache holds
        fewer than the whole prompt (or, on a sliding-window layer of window W, fewer than the
        last W - 1 tokens, which is what HF's sliding cache keeps), or more tokens than the
        model's positions."""
        cache_layers = getattr(prompt_cache, "layers", None)
        window = layers.context_window or total_len
        if not cache_layers or len(cache_layers) != layers.num_layers or total_len > window:
            return None
        kv = []
        for i, layer in enumerate(cache_layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            sliding = layers.sliding_window(i)
            held = prompt_len if sliding is None else min(prompt_len, int(sliding) - 1)
            if k is None or v is None or k.shape[-2] != held or v.shape[-2] != held:
                return None
            kv.append((k, v))
        return cls(
            layers,
            kv,
            total_len,
            prompt_len,
            kernels,
            kv_cache_dtype,
            activations,
            pool,
            layer_kernels,
        )

    def step(self, token: int) -> torch.Tensor:
        """Feed ``token`` at the next position; fp32 logits [vocab] for the one after it."""
        return decode_batch([self], [token])[0]


@torch.inference_mode()
def decode_batch(decoders: Sequence[LayerDecoder], tokens: Sequence[int]) -> torch.Tensor:
    """One decode step of several requests at once: fp32 logits [B, vocab], row b for
    ``decoders[b]`` fed ``tokens[b]``.

    The B new tokens go through every norm, projection and MLP as one [1, B, D] batch (one
    GEMM per linear for all requests, each row with its own RoPE position); attention runs
    per request, its one query row over its own preallocated K/V. With one decoder this is
    exactly :meth:`LayerDecoder.step`. All decoders must share one ``LayerwiseModel`` and one
    ``kv_cache_dtype`` and one ``activations`` (a RagblendError otherwise); the kernels of the
    first are used for all.
    """
    numerics = sorted({d.activations for d in decoders})
    if len(numerics) > 1:
        raise RagblendError(
            "decode_batch needs decoders of one decode_activations, got a batch mixing "
            + " and ".join(numerics)
        )
    with step_activations(numerics[0] if numerics else "float"):
        return _decode_batch(decoders, tokens)


def _decode_batch(decoders: Sequence[LayerDecoder], tokens: Sequence[int]) -> torch.Tensor:
    if not decoders or len(decoders) != len(tokens):
        raise ValueError("decode_batch needs one token per decoder, and at least one")
    cache_dtypes = sorted({d.kv_cache_dtype for d in decoders})
    if len(cache_dtypes) > 1:
        raise RagblendError(
            "decode_batch needs decoders of one kv_cache_dtype, got a batch mixing "
            + " and ".join(cache_dtypes)
        )
    m = decoders[0].layers
    for d in decoders:
        if d.position >= d.capacity:
            raise IndexError(f"the decode buffer holds {d.capacity} tokens")
    device = decoders[0].keys[0].device
    positions = [d.position for d in decoders]
    kernels = decoders[0].kernels
    fused = decoders[0].layer_kernels
    pool = decoders[0].pool
    if pool is not None and all(d.pool is pool for d in decoders):
        slots = [cast(int, d.slot) for d in decoders]  # one call per layer for them all
        logits = pool.step(list(tokens), positions, slots, kernels, fused)
        for d in decoders:
            d.position += 1
        return logits
    position_ids = torch.tensor(positions, device=device)
    attend = decoders[0].attend

    def attend_layer(i: int, proj: LayerProjections, window: int | None) -> torch.Tensor:
        if cache_dtypes[0] == "int8":
            return _attend_q8(decoders, i, positions, proj.q, proj.k, proj.v, window, m.scaling(i))
        if attend is None:
            return _attend_each(m, i, decoders, positions, proj.q, proj.k, proj.v, window)
        keys = [d.keys[i] for d in decoders]
        values = [d.values[i] for d in decoders]
        kv_dtype = keys[0].dtype
        q, k, v = proj.q.to(attend.q_dtype), proj.k.to(kv_dtype), proj.v.to(kv_dtype)
        out = attend.kernel(q, k, v, keys, values, positions, window or 0, m.scaling(i))
        return out.to(proj.q.dtype)

    hidden = m.embed(torch.tensor(list(tokens), device=device))
    logits = step_layers(m, hidden, position_ids, attend_layer, kernels, fused)
    for d in decoders:
        d.position += 1
    return logits


def decode_attention(
    layers: LayerwiseModel, kernels: NativeKernels | None
) -> DecodeAttention | None:
    """The native decode-step attention for this model: its own kernels' (fp32 models; bf16
    models where the bf16 kernels have one, at the ``avx512_bf16`` level), else, for a bf16
    model on CPU, the fp32 kernels' (which read its bf16 K/V as they are and compute in fp32:
    torch's CPU SDPA for one bf16 query row runs several times slower), or None for SDPA per
    request (other dtypes and devices, or where no kernel runs)."""
    if kernels is not None and kernels.decode_attend is not None:
        return DecodeAttention(kernels.decode_attend, kernels.dtype)
    if layers.dtype != torch.bfloat16 or layers.device.type != "cpu":
        return None
    fp32 = native_kernels("auto", torch.float32, layers.device, layers.head_dim)
    if fp32 is None or fp32.decode_attend is None:
        return None
    return DecodeAttention(fp32.decode_attend, torch.float32)


def _attend_each(
    m: LayerwiseModel,
    layer: int,
    decoders: Sequence[LayerDecoder],
    positions: Sequence[int],
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Each request's new K/V written at its position and its query row attending its own
    keys through SDPA; q [1, H, B, d], k_new, v_new [1, Hkv, B, d] → [1, B, H*d]."""
    groups = m.num_heads // m.num_kv_heads
    outs = []
    for b, (d, p) in enumerate(zip(decoders, positions)):
        k, v = d.keys[layer], d.values[layer]
        k[..., p : p + 1, :].copy_(k_new[:, :, b : b + 1])
        v[..., p : p + 1, :].copy_(v_new[:, :, b : b + 1])
        lo = 0 if window is None else max(0, p - int(window) + 1)
        outs.append(
            F.scaled_dot_product_attention(
                q[:, :, b : b + 1],
                k[..., lo : p + 1, :],
                v[..., lo : p + 1, :],
                scale=m.scaling(layer),
                enable_gqa=groups > 1,
            )
        )
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2).reshape(1, len(outs), -1)


def _attend_q8(
    decoders: Sequence[LayerDecoder],
    layer: int,
    positions: list[int],
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Layer ``layer``'s attention over int8 caches (the first decoder's ``attend_q8``), in
    fp32: q [1, H, B, d], k_new, v_new [1, Hkv, B, d] → [1, B, H*d] in q's dtype."""
    out = decoders[0].attend_q8(
        q.float(),
        k_new.float(),
        v_new.float(),
        [d.keys[layer] for d in decoders],
        [d.key_scales[layer] for d in decoders],
        [d.values[layer] for d in decoders],
        [d.value_scales[layer] for d in decoders],
        positions,
        window or 0,
        scale,
    )
    return out.to(q.dtype)
