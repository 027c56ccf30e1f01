"""Routing by chunk, as pure functions: which replica a request should go to.

``ragblend serve --ray`` runs one engine per replica, each with a RAM tier in front of the
shared store. A chunk served by a replica stays in that replica's RAM tier, so the next
request holding it is fastest there. The ingress finds the known chunks of a request
(:func:`request_chunks`, the server's own content matching) and names them by
:func:`chunk_id`; the router (``ragblend.serving.chunk_router``) then asks :func:`choose`
with its :class:`AffinityTable` (which replica each chunk was last sent to) and the replicas'
loads (requests in flight). No Ray here: the policy is tested as a function.

The policy: the replica that was sent most of the request's chunks recently wins (ties: the
less loaded, then the candidates' order); when it has more than ``load_bound`` requests in
flight beyond the least loaded replica, or when no candidate holds any of the chunks, the least
loaded replica takes the request (ties: the one holding the fewest chunks, so new chunks spread
the working set over the replicas' RAM tiers; then the candidates' order, which the router
shuffles).
"""

from __future__ import annotations

import json
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import xxhash

from ragblend.matching import ChunkIndex, best_split, find_chunks, split_text

#: reasons a choice was made (the router counts them by these names)
AFFINITY, LOAD, NEW_CHUNKS, NO_CHUNK = "affinity", "load", "new_chunks", "no_chunk"
REASONS = (AFFINITY, LOAD, NEW_CHUNKS, NO_CHUNK)
DEFAULT_LOAD_BOUND = 4
DEFAULT_TABLE_SIZE = 1 << 16

CHAT, COMPLETIONS, CHUNKS = "/v1/chat/completions", "/v1/completions", "/v1/ragblend/chunks"


def chunk_id(text: str) -> str:
    """A short, stable id of a chunk text (the same in every process)."""
    return xxhash.xxh64_hexdigest(text.encode("utf-8"))


class AffinityTable:
    """Which replica each chunk id was last sent to; the ``capacity`` most recent ids.

    Thread-safe. A replica that is gone is dropped with :meth:`forget`.
    """

    def __init__(self, capacity: int = DEFAULT_TABLE_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"an affinity table needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
        self._owner: OrderedDict[str, str] = OrderedDict()
        self._held: Counter[str] = Counter()  # chunks per replica
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._owner)

    def record(self, chunk_ids: Iterable[str], replica: str) -> None:
        """``replica`` was sent a request holding ``chunk_ids``: it holds them now."""
        with self._lock:
            for cid in chunk_ids:
                before = self._owner.get(cid)
                if before is not None:
                    self._held[before] -= 1
                self._owner[cid] = replica
                self._owner.move_to_end(cid)
                self._held[replica] += 1
            while len(self._owner) > self.capacity:
                _, dropped = self._owner.popitem(last=False)
                self._held[dropped] -= 1

    def owner(self, chunk: str) -> str | None:
        with self._lock:
            return self._owner.get(chunk)

    def held(self, replica: str) -> int:
        """How many chunks ``replica`` was last sent (of those remembered)."""
        with self._lock:
            return self._held[replica]

    def counts(self, chunk_ids: Iterable[str]) -> Counter[str]:
        """How many of ``chunk_ids`` each replica was last sent."""
        with self._lock:
            return Counter(r for r in (self._owner.get(c) for c in chunk_ids) if r is not None)

    def forget(self, replica: str) -> int:
        """Drop every chunk ``replica`` holds (it died or left); how many were dropped."""
        with self._lock:
            gone = [c for c, r in self._owner.items() if r == replica]
            for cid in gone:
                del self._owner[cid]
            self._held.pop(replica, None)
        return len(gone)


class RoutedCounts:
    """Requests routed, by (replica id, reason): every chunk router of a process counts here
    (:data:`ROUTED`), the ingress reads them for ``/metrics``."""

    def __init__(self) -> None:
        self._counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def count(self, replica: str, reason: str) -> None:
        with self._lock:
            self._counts[(replica, reason)] += 1

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


ROUTED = RoutedCounts()


@dataclass(frozen=True)
class Choice:
    """A routing decision: the replica and why (one of :data:`REASONS`)."""

    replica: str
    reason: str


def choose(
    chunk_ids: Sequence[str],
    candidates: Sequence[str],
    loads: Mapping[str, int | None],
    table: AffinityTable,
    load_bound: int = DEFAULT_LOAD_BOUND,
) -> Choice:
    """The replica among ``candidates`` (non-empty) for a request holding ``chunk_ids``.

    ``loads``: requests in flight per replica (missing or None: unknown, counted as 0).
    See the module docstring for the policy.
    """
    if not candidates:
        raise ValueError("no candidate replica to choose from")
    if load_bound < 0:
        raise ValueError(f"load_bound must be >= 0, got {load_bound}")
    order = {r: i for i, r in enumerate(candidates)}

    def load(replica: str) -> int:
        return loads.get(replica) or 0

    least = min(candidates, key=lambda r: (load(r), table.held(r), order[r]))
    if not chunk_ids:
        return Choice(least, NO_CHUNK)
    counts = table.counts(dict.fromkeys(chunk_ids))
    held = [r for r in candidates if counts[r] > 0]
    if not held:
        return Choice(least, NEW_CHUNKS)
    best = min(held, key=lambda r: (-counts[r], load(r), order[r]))
    if load(best) - load(least) > load_bound:
        return Choice(least, LOAD)
    return Choice(best, AFFINITY)


def request_chunks(path: str, body: bytes, index: ChunkIndex) -> list[str]:
    """The known chunk texts a request would fuse (as the server matches them), or the texts a
    ``POST /v1/ragblend/chunks`` precomputes; ``[]`` for any other path or a body that is not a
    JSON object (the replica answers those with its own errors)."""
    if path not in (CHAT, COMPLETIONS, CHUNKS):
        return []
    try:
        data = json.loads(body or b"null")
    except ValueError:
        return []
    if not isinstance(data, dict):
        return []
    if path == CHUNKS:
        texts = data.get("texts")
        return [t for t in texts if isinstance(t, str)] if isinstance(texts, list) else []
    if path == COMPLETIONS:
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            return []
        split = split_text(prompt, find_chunks(prompt, index))
        return split.chunks if split is not None else []
    raw = data.get("messages")
    if not isinstance(raw, list):
        return []
    messages = [{"content": _text(m.get("content"))} for m in raw if isinstance(m, dict)]
    found = best_split(messages, index)
    return found[1].chunks if found is not None else []


def _text(content: object) -> str:
    """A message's text as the server reads it (text parts joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(p.get("text") or "" for p in parts if isinstance(p.get("text"), str))
    return ""
