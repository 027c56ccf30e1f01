"""The CPU backend of the fusion path: ragblend's C++ kernels (``csrc/``, compiled on first use
per CPU level) and their loaders, each checked against HF's values when it loads.

:mod:`~ragblend.kernels.cpu.native`: selected-row attention, RoPE and RMSNorm for the fusor and
a decode step's attention; :mod:`~ragblend.kernels.cpu.decode_kernels`: the decode attention
builds; :mod:`~ragblend.kernels.cpu.decode_q8`: the 8-bit decode K/V cache's attention. The
quantized-weight kernels (``csrc/quant_*.cpp``, ``csrc/dense_bf16.cpp``) are loaded by
:mod:`ragblend.models`. The device-independent logic they serve is in :mod:`ragblend.fusion`.
"""
