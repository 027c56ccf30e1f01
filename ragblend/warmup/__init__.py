"""Precomputing chunk KV in the background, and the jobs that warm a whole corpus.

- :mod:`~ragblend.warmup.pool`: :class:`WarmupPool` (one pool for every prompt of a framework
  integration; retrieval misses first, then the ingestion backlog) and :class:`WarmupQueue`
  (one engine's queue, drained by a fresh thread);
- :mod:`~ragblend.warmup.command`: ``ragblend warmup`` over a dataset, into any store;
- :mod:`~ragblend.warmup.ray_actors`: ``ragblend warmup --ray``, an actor pool on a Ray cluster.
"""

from ragblend.warmup.pool import BACKLOG, RETRIEVAL, WarmupPool, WarmupQueue

__all__ = ["BACKLOG", "RETRIEVAL", "WarmupPool", "WarmupQueue"]
