"""BlendConfig: every knob of the fusion path in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Mode = Literal["full", "prefix", "reuse", "blend"]
MODES: tuple[str, ...] = ("full", "prefix", "reuse", "blend")
PrecomputeContext = Literal["prefix", "bos", "none"]


@dataclass
class BlendConfig:
    """Settings of the CacheBlend fusion path.

    ratio: fraction of the prompt's tokens recomputed on the layers after the last check layer
        (paper's r, default 0.15); ``"auto"`` lets the loading controller choose it.
    check_layers: layers at which tokens are (re)selected by the selector. Every layer up to and
        including the first check layer runs on all tokens.
    check_ratios: gradual filtering (paper §4.3): the fraction kept at each check layer, each
        selecting within the previous selection. ``None`` means ``[ratio]`` at every check layer.
        The last entry is the ratio used by all later layers.
    selector: name of a registered token selector (``kv-deviation``).
    deviation: which cached tensor the deviation is measured on: ``"k"``, ``"v"`` or ``"kv"``.
    precompute_context: what each chunk is prefilled after when its KV is precomputed:
        ``"prefix"`` (the prompt head: template + system prompt), ``"bos"`` or ``"none"``.
    """

    ratio: float | Literal["auto"] = 0.15
    check_layers: tuple[int, ...] = (1,)
    check_ratios: tuple[float, ...] | None = None
    selector: str = "kv-deviation"
    deviation: Literal["k", "v", "kv"] = "kv"
    precompute_context: PrecomputeContext = "prefix"
    mode: Mode = "blend"
    device: str = "cpu"
    dtype: str = "float32"
    max_new_tokens: int = 64
    ram_bytes: int = 4 << 30
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from ragblend.errors import RagblendError

        if self.mode not in MODES:
            raise RagblendError(f"unknown mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if self.ratio != "auto" and not (0.0 <= float(self.ratio) <= 1.0):
            raise RagblendError(f"ratio must be in [0, 1] or 'auto', got {self.ratio!r}")
        if not self.check_layers:
            raise RagblendError("check_layers must name at least one layer")
        if list(self.check_layers) != sorted(set(self.check_layers)) or self.check_layers[0] < 0:
            raise RagblendError(f"check_layers must be increasing and >= 0, got {self.check_layers}")
        if self.check_ratios is not None:
            if len(self.check_ratios) != len(self.check_layers):
                raise RagblendError("check_ratios needs one ratio per check layer")
            if any(not (0.0 <= r <= 1.0) for r in self.check_ratios):
                raise RagblendError(f"check_ratios must be in [0, 1], got {self.check_ratios}")
        if self.deviation not in ("k", "v", "kv"):
            raise RagblendError(f"deviation must be 'k', 'v' or 'kv', got {self.deviation!r}")
        if self.precompute_context not in ("prefix", "bos", "none"):
            raise RagblendError(f"unknown precompute_context {self.precompute_context!r}")

    def schedule(self, ratio: float | None = None) -> list[tuple[int, float]]:
        """(check layer, fraction kept) pairs; ``ratio`` overrides the final fraction."""
        final = float(self.ratio if ratio is None and self.ratio != "auto" else (ratio or 0.15))
        if self.check_ratios is None:
            ratios = [final] * len(self.check_layers)
        else:
            ratios = list(self.check_ratios)
            if ratio is not None:
                scale = final / ratios[-1] if ratios[-1] > 0 else 1.0
                ratios = [min(1.0, r * scale) for r in ratios]
        return list(zip(self.check_layers, ratios))
