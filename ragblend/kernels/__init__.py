"""Kernels, one backend per device, behind the one interface fusion, models and decode call.

- :mod:`ragblend.kernels.cpu`: ragblend's C++ kernels (``cpu/csrc``, compiled per CPU level on
  first use by :mod:`~ragblend.kernels.cpu.extensions`) and what loads them: selected-row
  attention, one-pass RoPE and RMSNorm (:func:`native_kernels`), decode attention over fp32,
  bf16 and q8_0 K/V, native dense decode linears, GGUF block kernels
  (:func:`quant_kernels`), and llama.cpp's int8 decode arithmetic with its integer reference.
- :mod:`ragblend.kernels.cuda`: one registered op per layer step with a torch reference on any
  device, and Triton kernels for CUDA (:func:`layer_kernels`).

:mod:`~ragblend.kernels.choice` resolves which of them one engine's config runs, on first use.

Every loader checks its kernels against the torch/HF reference when they load and returns None
(one warning) where they do not apply or disagree: callers then take torch's own ops. Nothing
here imports fusion, models or decode: kernels are the bottom layer.
"""

from ragblend.kernels.cpu.decode_q8 import int8_attention, q8_buffer
from ragblend.kernels.cpu.int8_decode import (
    in_int8_step,
    int8_kernels,
    resolve_decode_activations,
    step_activations,
)
from ragblend.kernels.cpu.native import (
    ROW_ATTENTION,
    DecodeKernel,
    NativeKernels,
    NormKernel,
    RopeKernel,
    RowAttention,
    RowKernel,
    check_row_attention,
    native_kernels,
)
from ragblend.kernels.cpu.quant_kernels import (
    MAX_ROWS,
    QUANT_TYPES,
    dequantize_reference,
    quant_kernels,
)
from ragblend.kernels.cuda.layer_ops import (
    LAYER_KERNELS,
    LayerKernels,
    LayerKernelsChoice,
    check_layer_kernels,
)
from ragblend.kernels.cuda.loading import layer_kernels

__all__ = [
    "LAYER_KERNELS",
    "MAX_ROWS",
    "QUANT_TYPES",
    "ROW_ATTENTION",
    "DecodeKernel",
    "LayerKernels",
    "LayerKernelsChoice",
    "NativeKernels",
    "NormKernel",
    "RopeKernel",
    "RowAttention",
    "RowKernel",
    "check_layer_kernels",
    "check_row_attention",
    "dequantize_reference",
    "in_int8_step",
    "int8_attention",
    "int8_kernels",
    "layer_kernels",
    "native_kernels",
    "q8_buffer",
    "quant_kernels",
    "resolve_decode_activations",
    "step_activations",
]
