"""The GPU backend of the fusion path: one registered op per layer step
(:mod:`~ragblend.kernels.cuda.layer_ops`, torch references of HF's arithmetic on any device)
and their Triton kernels for CUDA (:mod:`~ragblend.kernels.cuda.triton_layer`, checked against
the references when they load). The device-independent logic they serve is in
:mod:`ragblend.fusion`.
"""
