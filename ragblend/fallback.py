"""Why a blend/reuse request ran a full prefill: one stable code and one human message.

``BlendStats.fallback_reason`` is always one of the codes below (None when chunks were fused)
and ``BlendStats.fallback_message`` says the same for a person, with what fixes it. The engine,
the server (its responses' ``ragblend`` object) and the integrations (which mirror the code in
``stats.extra["fallback_reason"]``) all use them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ragblend.decode import BlendStats

NO_KNOWN_CHUNK = "no_known_chunk"
CACHE_MISS = "cache_miss"
CONTROLLER_FULL = "controller_full"

MESSAGES = {
    NO_KNOWN_CHUNK: "no known chunk occurs in the prompt: precompute the chunks first",
    CACHE_MISS: "every chunk in the prompt missed the KV store: precompute them (or wait for "
    "warmup)",
    CONTROLLER_FULL: "the loading controller judged loading the chunks slower than a full "
    "prefill here",
}


def fall_back(stats: BlendStats, reason: str, message: str | None = None) -> None:
    """Record on ``stats`` that a full prefill ran for ``reason`` (a code of this module);
    ``message`` is a more specific text than the code's default."""
    if reason not in MESSAGES:
        raise ValueError(f"unknown fallback reason {reason!r}; one of {sorted(MESSAGES)}")
    stats.mode = "full"
    stats.fallback_reason = reason
    stats.fallback_message = message or MESSAGES[reason]
