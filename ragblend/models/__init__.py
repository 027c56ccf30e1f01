"""Model loading and the per-family layer-wise adapters."""

from ragblend.models.adapters import SUPPORTED_ARCHITECTURES, LayerwiseModel, adapter_for
from ragblend.models.loading import load_model

__all__ = ["SUPPORTED_ARCHITECTURES", "LayerwiseModel", "adapter_for", "load_model"]
