"""CacheBlend fusion: masks and attention for selected rows, token selectors, the fusor loop."""

from ragblend.fusion.attention import RowAttentionPlan, attend_rows, position_mask
from ragblend.fusion.fusor import FusionResult, Segment, fuse
from ragblend.fusion.selection import make_selector
from ragblend.fusion.selectors import SELECTORS, CheckLayer, TokenSelector, register_selector
from ragblend.fusion.trace import FusionTrace, PreRopeCapture, SelectionTrace

__all__ = [
    "SELECTORS",
    "CheckLayer",
    "FusionResult",
    "FusionTrace",
    "PreRopeCapture",
    "RowAttentionPlan",
    "Segment",
    "SelectionTrace",
    "TokenSelector",
    "attend_rows",
    "fuse",
    "make_selector",
    "register_selector",
    "position_mask",
]
