"""Decoding after a prefill: the one entry point the engine and the server call.

Layers, bottom up (each module imports only the ones above it in this list):

- :mod:`~ragblend.decode.detokenize`: incremental detokenisation, each token id → its new text;
- :mod:`~ragblend.decode.sampling`: next-token choice (greedy, temperature/top-p/top-k,
  penalties) and log-probabilities;
- :mod:`~ragblend.decode.loop`: one request's decode bookkeeping (:class:`DecodeState`: stop
  conditions, stop strings, what to show);
- :mod:`~ragblend.decode.layers`: the layers of one decode step, shared by the per-request
  decoders and the pool;
- :mod:`~ragblend.decode.graph`: a CUDA graph of a pool's whole step;
- :mod:`~ragblend.decode.pool`: the static K/V pool requests decoded together share;
- :mod:`~ragblend.decode.decoder`: :class:`LayerDecoder`, one token at a time into
  preallocated K/V, and :func:`decode_batch` for a step of several requests;
- :mod:`~ragblend.decode.generation`: the drivers (``generate``, streams, HF's own decoder for
  what the layer-wise one does not cover) and the result types.
- :mod:`~ragblend.decode.setup`: one engine's decoding (:class:`DecodeSetup`: its decode
  options resolved, its static pools, the decoders, greedy answers and teacher-forced logits
  ``BlendEngine`` hands out).

The kernels these call live in :mod:`ragblend.kernels`, one backend per device.
"""

from ragblend.decode.decoder import LayerDecoder, decode_batch
from ragblend.decode.generation import (
    BlendResult,
    BlendStats,
    BlendStream,
    Decoder,
    HFDecoder,
    Prefill,
    decode_tokens,
    decoder_for,
    teacher_forced_logits,
)
from ragblend.decode.loop import DecodeState, decode_steps
from ragblend.decode.pool import DecodePool
from ragblend.decode.sampling import (
    Sampler,
    SamplingParams,
    TokenLogprobs,
    greedy_choices,
    token_logprobs,
)

__all__ = [
    "BlendResult",
    "BlendStats",
    "BlendStream",
    "DecodePool",
    "DecodeState",
    "Decoder",
    "HFDecoder",
    "LayerDecoder",
    "Prefill",
    "Sampler",
    "SamplingParams",
    "TokenLogprobs",
    "decode_batch",
    "decode_steps",
    "decode_tokens",
    "decoder_for",
    "greedy_choices",
    "teacher_forced_logits",
    "token_logprobs",
]
