"""Which kernels one engine runs: ``BlendConfig.row_attention`` and ``layer_kernels`` resolved
for a model's dtype, device and head dim, each on first use."""

from __future__ import annotations

import copy
from typing import cast

import torch

from ragblend.kernels.cpu.native import NativeKernels, native_kernels
from ragblend.kernels.cuda.layer_ops import LayerKernels
from ragblend.kernels.cuda.loading import layer_kernels

_UNRESOLVED = object()  # a kernel set not asked for yet


class KernelChoice:
    """The native CPU kernels and fused layer steps for ``row_attention`` and
    ``layer_kernels`` (``BlendConfig``'s options), built on first use: engines that only
    precompute (warmup jobs, Ray actors) never compile or load them. ``row_attention="native"``
    builds them at once, so its error (if any) comes at start-up, not mid-query."""

    def __init__(
        self,
        row_attention: str,
        layer_kernels: str,
        dtype: torch.dtype,
        device: torch.device,
        head_dim: int,
    ) -> None:
        self.options = (row_attention, layer_kernels)
        self.dtype, self.device, self.head_dim = dtype, device, head_dim
        self._native: NativeKernels | None | object = _UNRESOLVED
        self._steps: LayerKernels | None | object = _UNRESOLVED
        if row_attention == "native":
            self._native = self._build_native()

    def with_options(self, row_attention: str, layer_kernels: str) -> KernelChoice:
        """A copy for other options; what they do not change stays as resolved here."""
        choice = copy.copy(self)
        if (row_attention, layer_kernels) != self.options:
            choice._steps = _UNRESOLVED
        choice.options = (row_attention, layer_kernels)
        if row_attention != self.options[0]:
            choice._native = _UNRESOLVED
            if row_attention == "native":
                choice._native = choice._build_native()
        return choice

    def _build_native(self) -> NativeKernels | None:
        return native_kernels(self.options[0], self.dtype, self.device, self.head_dim)

    @property
    def native(self) -> NativeKernels | None:
        """The native CPU kernels (:mod:`ragblend.kernels.cpu.native`), or None for SDPA."""
        if self._native is _UNRESOLVED:
            self._native = self._build_native()
        return cast("NativeKernels | None", self._native)

    @native.setter
    def native(self, kernels: NativeKernels | None) -> None:
        self._native = kernels

    @property
    def layer_kernels(self) -> LayerKernels | None:
        """The fused layer steps, or None for HF's modules (and wherever the native CPU
        kernels run)."""
        if self._steps is _UNRESOLVED:
            self._steps = (
                None
                if self.native is not None
                else layer_kernels(self.options[1], self.device, self.dtype)
            )
        return cast("LayerKernels | None", self._steps)

    @property
    def row_attention(self) -> str:
        """The selected-row attention blend runs: ``"native"``, ``"masked"`` (one SDPA call
        per layer, masks built on the device: a GPU's default) or ``"sdpa"`` (blocks)."""
        if self.native is not None:
            return "native"
        choice = self.options[0]
        on_gpu = self.device.type != "cpu"
        return "masked" if choice == "masked" or (choice == "auto" and on_gpu) else "sdpa"
