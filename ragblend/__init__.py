"""ragblend: CacheBlend (fused chunk KV caches with selective recompute) on HF transformers."""

from ragblend.config import BlendConfig, SelectionPolicy
from ragblend.decode import BlendResult, BlendStats, BlendStream, SamplingParams
from ragblend.engine import BlendEngine
from ragblend.errors import RagblendError, UnsupportedModelError
from ragblend.prompt import PromptFormat

__all__ = [
    "BlendConfig",
    "BlendEngine",
    "BlendResult",
    "BlendStats",
    "BlendStream",
    "PromptFormat",
    "SamplingParams",
    "SelectionPolicy",
    "RagblendError",
    "UnsupportedModelError",
]
__version__ = "0.1.0"
